//! What the service learns per GPU from the peaks of jobs that really ran there (placing an
//! estimate on a GPU with it is [`crate::placement`]'s).
//!
//! - [`profile`]: one GPU's calibration profile (offset, scale, residual quantiles) and how it
//!   moves an estimate.
//! - [`environment`]: what a software environment changes per category of the breakdown
//!   (context, allocator's fixed cost, activation and cache scales), fitted from a few peaks.
//! - [`fit`]: the robust line (Theil–Sen) and the residual quantiles behind a profile.
//! - [`db`]: the stored observations (SQLite or PostgreSQL), schema migrations, a damaged
//!   SQLite store set aside at start.
//! - [`wal`]: a SQLite write-ahead log read as recovery will, to see what it would drop.
//! - [`store`]: profiles per GPU and per GPU and environment, derived from the observations
//!   and held in memory.
//! - [`step_time`]: the host's cost per op fitted to observed step times, the one roofline
//!   constant that belongs to the environment.
//! - [`label`]: the environment label.

pub mod db;
pub mod environment;
pub mod export;
pub mod fit;
pub mod label;
pub mod profile;
pub mod step_time;
pub mod store;
pub mod wal;

//! The bound: one home for the answer's distribution. What a figure leaves open, as held-out
//! errors of figures like it (`distribution`: residual groups, the peak's terms, the assumed
//! fields' widening, a profile's fitted scale, the bound at a confidence, the OOM
//! probability), the residual quantiles and widening rules of the learned and simulated
//! figures (`learned`), and whether the bound fits a card and how many copies do (`fit`).
//! Physics counts the terms; estimators, placement and calibration ask this room what they
//! mean for the bound.

pub mod distribution;
pub mod fit;
pub mod learned;

pub use distribution::{PeakDistribution, Terms};

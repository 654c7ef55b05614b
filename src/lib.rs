//! gpucast: estimates the GPU memory and utilization of a deep-learning training job from its
//! description, before it runs.

pub mod api;
pub mod bound;
pub mod calibration;
pub mod cli;
pub mod config;
pub mod devices;
pub mod engine;
pub mod error;
pub mod estimators;
pub mod http;
pub mod hub;
pub mod job;
pub mod kubernetes;
pub mod metrics;
pub mod parsers;
pub mod physics;
pub mod placement;
pub mod shutdown;
pub mod startup;
pub mod telemetry;
pub mod tls;

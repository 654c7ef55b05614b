//! Integration tests: each starts the real server on an ephemeral port with the committed
//! models and talks to it over HTTP.

mod accuracy;
mod admission;
mod admission_pods;
mod assumed;
mod batch;
mod calibration;
#[path = "../common/mod.rs"]
mod common;
mod config_setups;
mod cost;
mod docs;
mod environment;
mod estimate;
mod extrapolation;
mod files;
mod floor_sweep;
mod gpus;
mod helpers;
mod host_memory;
mod invariants;
mod operations;
mod plan;
mod public_setups;
mod ranking;
mod real_models;
mod reuse;
mod roofline;
mod saved_tensors;
mod setups;
mod simulation;
mod startup;
mod step_time;
mod store;
mod summary;
mod transformer_config;

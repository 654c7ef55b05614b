//! The wire: what clients send and receive (types kept apart from the domain's, so the API
//! stays stable while the internals change), how untrusted JSON becomes them, how an error reads to a
//! client (`problem`), the mappings both faces (HTTP and the CLI) share, and the names the setup
//! fields take (`vocabulary`).

pub mod answer;
pub mod gpus;
pub mod parse;
pub mod problem;
pub mod types;
pub mod unique_keys;
pub mod vocabulary;

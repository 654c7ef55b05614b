use clap::Parser;

use gpucast::config::{Cli, Command, ObservationsCommand};
use gpucast::startup::Application;

/// mimalloc serves the service's allocations: an estimate makes hundreds of small ones (a
/// config job's module names and layers, JSON values), which glibc's malloc serves through
/// its locked bins once its small per-thread cache is spent.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match &cli.command {
        // No runtime, no server: the answer and the exit status.
        Command::Estimate(args) => std::process::exit(gpucast::cli::estimate(args)),
        Command::Plan(args) => std::process::exit(gpucast::cli::plan(args)),
        Command::Gpus { format } => std::process::exit(gpucast::cli::gpus(*format)),
        Command::Features(args) => std::process::exit(gpucast::cli::features(args)),
        Command::Combine(args) => std::process::exit(gpucast::cli::combine(args)),
        Command::Observations(ObservationsCommand::Record(args)) => {
            std::process::exit(gpucast::cli::record(args))
        }
        _ => {}
    }
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    // Estimates run on the estimate threads (http::pool), one per core; the blocking pool
    // holds the store's calls and NVML: more threads than that only add memory (each thread
    // grows its own allocator arena) and queueing inside the OS.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(2 * cores)
        .build()?;
    let result = runtime.block_on(run(cli));
    // The drain has waited for every request; a store call still on the blocking pool
    // outlived its request's timeout, and dropping the runtime would wait for it without bound.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Openapi => {
            println!("{}", gpucast::http::openapi().to_pretty_json()?);
            Ok(())
        }
        Command::LayerKinds => {
            let vocabulary = gpucast::parsers::vocabulary::layer_vocabulary();
            println!("{}", serde_json::to_string_pretty(&vocabulary)?);
            Ok(())
        }
        Command::Vocabulary => {
            let vocabulary = gpucast::api::vocabulary::setup_vocabulary();
            println!("{}", serde_json::to_string_pretty(&vocabulary)?);
            Ok(())
        }
        Command::Observations(ObservationsCommand::Export { store, output }) => {
            let written = tokio::task::spawn_blocking(move || {
                gpucast::calibration::export::export(
                    &store.data_dir,
                    store.database_url.as_ref().map(|u| u.expose()),
                    output.as_deref(),
                )
            })
            .await??;
            eprintln!("gpucast: {written} observations exported");
            Ok(())
        }
        Command::Estimate(_)
        | Command::Plan(_)
        | Command::Gpus { .. }
        | Command::Features(_)
        | Command::Combine(_)
        | Command::Observations(ObservationsCommand::Record(_)) => {
            unreachable!("answered before the runtime starts")
        }
        Command::Serve(config) => {
            gpucast::telemetry::init(config.log_format);
            tracing::info!(?config, "starting");
            let app = match Application::build(&config).await {
                Ok(app) => app,
                Err(e) => {
                    // One line naming what failed, then a non-zero exit.
                    tracing::error!("{e}");
                    eprintln!("gpucast: {e}");
                    std::process::exit(1);
                }
            };
            app.run_until(gpucast::shutdown::signal()).await?;
            tracing::info!("stopped");
            Ok(())
        }
    }
}

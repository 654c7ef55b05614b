use clap::Parser;

use gpucast::config::{Cli, Command};
use gpucast::startup::Application;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Openapi => {
            println!("{}", gpucast::http::openapi().to_pretty_json()?);
            Ok(())
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

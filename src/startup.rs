//! The application: load and check every estimator, bind, then serve until shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::calibration::profile::ProfileError;
use crate::calibration::store::ProfileStore;
use crate::config::ServeConfig;
use crate::devices::nvml::NvmlDevices;
use crate::devices::watch::Sampler;
use crate::devices::{GpuDevices, NoDevices};
use crate::estimators::{Estimators, LoadError};
use crate::http::auth::WriteAccess;
use crate::http::idempotency::{self, IdempotencyKeys};
use crate::http::{self, AppState, Limits};
use crate::metrics::Metrics;

pub struct Application {
    listener: TcpListener,
    port: u16,
    state: AppState,
}

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Models(#[from] LoadError),
    #[error("calibration profiles: {0}")]
    Profiles(#[from] ProfileError),
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: std::net::SocketAddr,
        source: std::io::Error,
    },
}

impl Application {
    /// Loads the models (failing on any missing, corrupt or mismatched file), then binds.
    /// GPUs are found through NVML; a host without a driver serves estimates all the same.
    pub async fn build(config: &ServeConfig) -> Result<Application, StartupError> {
        let devices: Arc<dyn GpuDevices> = if config.no_nvml {
            Arc::new(NoDevices::new("NVML disabled by --no-nvml"))
        } else {
            Arc::from(
                tokio::task::spawn_blocking(NvmlDevices::detect)
                    .await
                    .expect("NVML detection does not panic"),
            )
        };
        Application::build_with_devices(config, devices).await
    }

    /// As [`Application::build`], with the given devices (tests use a fake one).
    pub async fn build_with_devices(
        config: &ServeConfig,
        devices: Arc<dyn GpuDevices>,
    ) -> Result<Application, StartupError> {
        config.validate().map_err(StartupError::Config)?;
        match devices.unavailable_reason() {
            Some(reason) => {
                tracing::info!(%reason, "no NVML device; estimates are served without one")
            }
            None => tracing::info!(
                devices = devices.list().map(|d| d.len()).unwrap_or(0),
                "NVML devices found"
            ),
        }
        let (profiles, warnings) = ProfileStore::load(&config.profiles)?;
        for warning in &warnings {
            tracing::warn!(%warning, "calibration profile skipped");
        }
        tracing::info!(dir = %config.profiles.display(), profiles = profiles.list().len(), "calibration profiles loaded");
        let started = Instant::now();
        let estimators = {
            let (models, dylib, sessions) = (
                config.models.clone(),
                config.ort_dylib.clone(),
                config.sessions_per_model,
            );
            tokio::task::spawn_blocking(move || Estimators::load(&models, &dylib, sessions))
                .await
                .expect("model loading does not panic")?
        };
        tracing::info!(
            models = %config.models.display(),
            estimators = estimators.all().len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "estimators loaded and checked"
        );
        let metrics = Metrics::new();
        metrics
            .build_info
            .with_label_values(&[
                env!("CARGO_PKG_VERSION"),
                estimators
                    .manifest()
                    .generated_at
                    .as_deref()
                    .unwrap_or("unknown"),
            ])
            .set(1);
        for profile in profiles.list() {
            metrics.record_calibration(
                &profile.sku,
                profile.observations,
                profile.scale,
                profile.offset_mib,
            );
        }
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| StartupError::Bind {
                    address: config.listen,
                    source,
                })?;
        let bound = listener.local_addr().map_err(|source| StartupError::Bind {
            address: config.listen,
            source,
        })?;
        let port = bound.port();
        let writes = WriteAccess::new(config.token.clone(), bound);
        match writes {
            WriteAccess::Disabled => tracing::warn!(address = %bound, "{}", writes.describe()),
            _ => tracing::info!(address = %bound, "{}", writes.describe()),
        }
        let state = AppState {
            estimators: Arc::new(estimators),
            metrics: Arc::new(metrics),
            ready: Arc::new(AtomicBool::new(false)),
            limits: Limits {
                max_body_bytes: config.max_body_bytes,
                max_batch_items: config.max_batch_items,
                request_timeout: Duration::from_secs(config.request_timeout_secs),
            },
            permits: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            profiles: Arc::new(profiles),
            writes,
            watches: Arc::new(Sampler::new(devices.clone(), config.max_watches)),
            idempotency: Arc::new(IdempotencyKeys::new(
                idempotency::KEY_TTL,
                idempotency::MAX_KEYS,
            )),
            devices,
        };
        Ok(Application {
            listener,
            port,
            state,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until `shutdown` resolves, then stops accepting, marks itself not ready and
    /// finishes the requests in flight.
    pub async fn run_until(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let ready = self.state.ready.clone();
        let watches = Arc::clone(&self.state.watches);
        let router = http::router(self.state);
        ready.store(true, Ordering::Release);
        tracing::info!(address = %self.listener.local_addr()?, "ready");
        axum::serve(self.listener, router)
            .with_graceful_shutdown(async move {
                shutdown.await;
                ready.store(false, Ordering::Release);
                watches.stop();
            })
            .await
    }
}

//! The application: load and check every estimator, bind, then serve until shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::calibration::db::Retention;
use crate::calibration::profile::ProfileError;
use crate::calibration::store::ProfileStore;
use crate::config::ServeConfig;
use crate::devices::catalogue::CatalogueError;
use crate::devices::nvml::NvmlDevices;
use crate::devices::sku::Catalogue;
use crate::devices::watch::Sampler;
use crate::devices::{GpuDevices, NoDevices};
use crate::engine::memo::AnswerMemo;
use crate::engine::Engine;
use crate::estimators::{Estimators, LoadError};
use crate::http::auth::{WriteAccess, WriteHosts};
use crate::http::idempotency::{self, IdempotencyKeys};
use crate::http::pool::CpuPool;
use crate::http::{self, AppState, Limits};
use crate::metrics::Metrics;

pub struct Application {
    listener: TcpListener,
    port: u16,
    /// `--health-listen`'s socket, bound at build, served on its own thread from `run_until`.
    health: Option<std::net::TcpListener>,
    state: AppState,
    timeouts: ConnectionTimeouts,
    /// How often the profiles are re-derived from the store.
    profile_refresh: Duration,
    /// `--tls-cert`/`--tls-key`: connections are TLS.
    tls: Option<tokio_rustls::TlsAcceptor>,
}

/// What bounds a connection rather than a request.
#[derive(Debug, Clone, Copy)]
struct ConnectionTimeouts {
    /// A request's header must arrive within this, or the connection is closed.
    header_read: Duration,
    /// A shutdown closes whatever is still open after this.
    drain: Duration,
    /// Connections open at once from one client address.
    per_address: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Models(#[from] LoadError),
    #[error("calibration profiles: {0}")]
    Profiles(#[from] ProfileError),
    #[error(transparent)]
    Gpus(#[from] CatalogueError),
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
        let catalogue = match &config.gpus {
            None => Catalogue::builtin().clone(),
            Some(path) => {
                let catalogue = Catalogue::load(path)?;
                tracing::info!(file = %path.display(), gpus = catalogue.all().len(), "GPU catalogue extended");
                catalogue
            }
        };
        // Checked before the models load: a wrong product or certificate fails at once.
        let admission = if config.admission {
            let cluster =
                crate::kubernetes::ClusterProducts::new(&catalogue, &config.admission_products)
                    .map_err(StartupError::Config)?;
            tracing::info!(
                products = cluster.products().collect::<Vec<_>>().join(","),
                "the Kubernetes admission webhook places on these GPU products"
            );
            Some(Arc::new(cluster))
        } else {
            None
        };
        let tls = match (&config.tls_cert, &config.tls_key) {
            (Some(cert), Some(key)) => {
                Some(crate::tls::acceptor(cert, key).map_err(StartupError::Config)?)
            }
            (None, None) => None,
            _ => {
                return Err(StartupError::Config(
                    "--tls-cert and --tls-key go together".into(),
                ))
            }
        };
        match devices.unavailable_reason() {
            Some(reason) => {
                tracing::info!(%reason, "no NVML device; estimates are served without one")
            }
            None => tracing::info!(
                devices = devices.list().map(|d| d.len()).unwrap_or(0),
                "NVML devices found"
            ),
        }
        let (profiles, warnings) = {
            let (dir, url) = (
                config.data_dir.clone(),
                config.database_url.as_ref().map(|u| u.expose().to_string()),
            );
            let retention = Retention {
                per_key: config.max_observations_per_key,
                total: config.max_observations,
                bytes: config.max_store_bytes,
            };
            tokio::task::spawn_blocking(move || ProfileStore::open(&dir, url.as_deref(), retention))
                .await
                .expect("opening the store does not panic")?
        };
        for warning in &warnings {
            tracing::warn!(%warning, "calibration store: set aside or skipped at start");
        }
        tracing::info!(store = %profiles.describe(), profiles = profiles.list().len(), "calibration profiles derived from the stored observations");
        let started = Instant::now();
        let estimators = {
            let (models, dylib, sessions) = (
                crate::config::located(&config.models),
                crate::config::located(&config.ort_dylib),
                config.sessions_per_model,
            );
            tokio::task::spawn_blocking(move || Estimators::load(&models, &dylib, sessions))
                .await
                .expect("model loading does not panic")?
        };
        tracing::info!(
            models = %crate::config::located(&config.models).display(),
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
        for profile in &profiles.list() {
            metrics.record_calibration(profile);
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
        let health = config
            .health_listen
            .map(|address| {
                std::net::TcpListener::bind(address)
                    .and_then(|l| l.set_nonblocking(true).map(|()| l))
                    .map_err(|source| StartupError::Bind { address, source })
            })
            .transpose()?;
        let writes = WriteAccess::new(config.token.clone(), bound);
        match writes {
            WriteAccess::Disabled => tracing::warn!(address = %bound, "{}", writes.describe()),
            _ => tracing::info!(address = %bound, "{}", writes.describe()),
        }
        let metrics = Arc::new(metrics);
        // One estimate thread per core: more only queue inside the OS.
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let pool = CpuPool::new(cores, Arc::clone(&metrics)).map_err(|error| {
            StartupError::Config(format!("cannot start the estimate threads: {error}"))
        })?;
        let state = AppState {
            engine: Arc::new(Engine {
                estimators: Arc::new(estimators),
                catalogue: Arc::new(catalogue),
                profiles: Arc::new(profiles),
                metrics,
                devices: devices.clone(),
                cost_budget: config.max_request_cost,
                memo: AnswerMemo::new(config.answer_memo_mib.saturating_mul(1 << 20)),
            }),
            ready: Arc::new(AtomicBool::new(false)),
            limits: Limits {
                max_body_bytes: config.max_body_bytes,
                max_batch_items: config.max_batch_items,
                request_timeout: Duration::from_secs(config.request_timeout_secs),
                body_read_timeout: Duration::from_secs(config.body_read_timeout_secs),
            },
            permits: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            batch_slots: Arc::new(Semaphore::new(config.max_concurrent_batches)),
            pool: Arc::new(pool),
            writes,
            watches: Arc::new(Sampler::new(devices.clone(), config.max_watches)),
            idempotency: Arc::new(IdempotencyKeys::new(
                idempotency::KEY_TTL,
                idempotency::MAX_KEYS,
                idempotency::MAX_ANSWER_BYTES,
            )),
            write_hosts: Arc::new(WriteHosts::new(bound, &config.allowed_hosts)),
            body_budget: Arc::new(Semaphore::new(
                config.max_body_bytes_in_flight.div_ceil(1024),
            )),
            admission,
            connection_slots: Arc::new(Semaphore::new(config.max_connections)),
        };
        Ok(Application {
            listener,
            port,
            health,
            state,
            profile_refresh: Duration::from_secs(config.profile_refresh_secs),
            tls,
            timeouts: ConnectionTimeouts {
                header_read: Duration::from_secs(config.header_read_timeout_secs),
                per_address: config.max_connections_per_address,
                drain: Duration::from_secs(config.drain_timeout_secs),
            },
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// The health listener's port (`--health-listen`), when there is one.
    pub fn health_port(&self) -> Option<u16> {
        self.health
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .map(|a| a.port())
    }

    /// Serves until `shutdown` resolves, then stops accepting, marks itself not ready and
    /// finishes the requests in flight, for at most the drain timeout.
    ///
    /// hyper's own connection loop rather than `axum::serve`, for what that does not offer: a
    /// header read timeout (a client that never finishes its header would hold a connection,
    /// and a graceful shutdown, forever) and a bounded drain.
    pub async fn run_until(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let Application {
            listener,
            health,
            state,
            timeouts,
            profile_refresh,
            tls,
            ..
        } = self;
        let ready = state.ready.clone();
        let watches = Arc::clone(&state.watches);
        let refresher = tokio::spawn(refresh_profiles(state.clone(), profile_refresh));
        let health = health
            .map(|listener| HealthListener::start(listener, state.clone(), timeouts.header_read))
            .transpose()?;
        let slots = Arc::clone(&state.connection_slots);
        let router = http::router(state);
        ready.store(true, Ordering::Release);
        tracing::info!(address = %listener.local_addr()?, tls = tls.is_some(), "ready");
        let connections = accept_until(
            listener,
            router,
            tls,
            Caps {
                slots,
                per_address: timeouts.per_address,
            },
            timeouts.header_read,
            shutdown,
        )
        .await;
        refresher.abort();
        ready.store(false, Ordering::Release);
        watches.stop();
        if tokio::time::timeout(timeouts.drain, connections.shutdown())
            .await
            .is_err()
        {
            tracing::warn!(
                drain_secs = timeouts.drain.as_secs(),
                "connections still open after the drain timeout are closed"
            );
        }
        // Probes keep their answer (not ready) through the drain, then the listener goes.
        drop(health);
        Ok(())
    }
}

/// Accepts connections on `listener` and serves `router` on each until `shutdown` resolves,
/// then stops accepting; the connections still open are the caller's to drain. hyper's own
/// connection loop rather than `axum::serve`, for what that does not offer: a header read
/// timeout (a client that never finishes its header would hold a connection, and a graceful
/// shutdown, forever) and a cap on connections open at once. With `tls`, each connection's
/// handshake runs on its own task, holding the connection's slot, and must end within the
/// header timeout too: a client that opens a connection and never shakes hands is closed like
/// one that never sends its header. One client address holds at most `caps.per_address`
/// connections, and a quarter of those (at most [`MAX_HANDSHAKES_PER_ADDRESS`]) in a TLS
/// handshake, so that one address cannot take every connection from the others.
async fn accept_until(
    listener: TcpListener,
    router: axum::Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    caps: Caps,
    header_read: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) -> hyper_util::server::graceful::GracefulShutdown {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::server::graceful::GracefulShutdown;
    use hyper_util::service::TowerToHyperService;

    let connections = GracefulShutdown::new();
    let mut connection = hyper::server::conn::http1::Builder::new();
    connection
        .timer(TokioTimer::new())
        .header_read_timeout(header_read)
        .max_buf_size(READ_BUFFER_BYTES);
    let connection_slots = caps.slots;
    let per_address = Arc::new(PerAddress::new(caps.per_address));
    let handshakes = Arc::new(PerAddress::new(
        (caps.per_address / 4).clamp(1, MAX_HANDSHAKES_PER_ADDRESS),
    ));
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors, say: wait a little rather than spin.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Every connection holds its slot until it ends: past the cap, a new one is closed at
        // once rather than queued in memory.
        // The address's own cap first: one address past it takes no global slot.
        let Some(address_slot) = per_address.try_take(peer.ip()) else {
            tracing::debug!("connection closed: the address's connection cap is reached");
            drop(stream);
            continue;
        };
        let Ok(slot) = connection_slots.clone().try_acquire_owned() else {
            tracing::debug!("connection closed: the connection cap is reached");
            drop(stream);
            continue;
        };
        let slot = (slot, address_slot);
        let service = TowerToHyperService::new(router.clone());
        if let Some(tls) = &tls {
            let Some(handshake) = handshakes.try_take(peer.ip()) else {
                tracing::debug!("connection closed: the address's TLS handshake cap is reached");
                drop(stream);
                continue;
            };
            let (tls, connection, watcher) =
                (tls.clone(), connection.clone(), connections.watcher());
            tokio::spawn(async move {
                let shaken = tokio::time::timeout(header_read, tls.accept(stream)).await;
                drop(handshake);
                let stream = match shaken {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(error)) => {
                        tracing::debug!(%error, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!("TLS handshake timed out");
                        return;
                    }
                };
                let served =
                    watcher.watch(connection.serve_connection(TokioIo::new(stream), service));
                if let Err(error) = served.await {
                    tracing::debug!(%error, "connection ended with an error");
                }
                drop(slot);
            });
            continue;
        }
        let served = connections.watch(connection.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(error) = served.await {
                tracing::debug!(%error, "connection ended with an error");
            }
            drop(slot);
        });
    }
    connections
}

/// The connection caps of a listener: its slots (shared with `/readyz`, which says not
/// ready while none is left) and the most one client address holds.
struct Caps {
    slots: Arc<Semaphore>,
    per_address: usize,
}

/// The most TLS handshakes one client address has in progress at once.
const MAX_HANDSHAKES_PER_ADDRESS: usize = 32;

/// What each client address holds open (connections, or handshakes), each held by a guard
/// ([`AddressSlot`]). An entry lives while its address holds something, so the map is no
/// larger than the connections open.
struct PerAddress {
    cap: usize,
    open: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
}

impl PerAddress {
    fn new(cap: usize) -> PerAddress {
        PerAddress {
            cap,
            open: std::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// One more for `address`, or `None` when it holds its cap.
    fn try_take(self: &Arc<Self>, address: std::net::IpAddr) -> Option<AddressSlot> {
        let address = client_key(address);
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(address).or_insert(0);
        if *count >= self.cap {
            return None;
        }
        *count += 1;
        Some(AddressSlot {
            table: Arc::clone(self),
            address,
        })
    }
}

/// One connection (or handshake) of an address, given back when dropped.
struct AddressSlot {
    table: Arc<PerAddress>,
    address: std::net::IpAddr,
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self.table.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.address);
            }
        }
    }
}

/// The client an address counts for: an IPv4 address (IPv4-mapped IPv6 as IPv4) itself, an
/// IPv6 address by its /64 (one host is commonly given a whole /64).
fn client_key(address: std::net::IpAddr) -> std::net::IpAddr {
    match address.to_canonical() {
        std::net::IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            std::net::IpAddr::V6(std::net::Ipv6Addr::from(bits))
        }
        v4 => v4,
    }
}

/// The most a connection's read buffer holds (hyper's default is about 400 KB): bodies are
/// charged to the budget as they leave it, so this bounds what a connection holds beyond its
/// charge (a thousand connections sending at once: 64 MiB, not 400).
const READ_BUFFER_BYTES: usize = 64 * 1024;

/// Connections the health listener holds open at once: probes, not traffic.
const HEALTH_CONNECTIONS: usize = 64;

/// `/healthz` and `/readyz` on a second address, served by a one-thread runtime on a thread of
/// its own: no estimate, connection flood or busy worker on the main port delays them. Stops
/// when dropped.
struct HealthListener {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HealthListener {
    fn start(
        listener: std::net::TcpListener,
        state: AppState,
        header_read: Duration,
    ) -> std::io::Result<HealthListener> {
        let address = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("gpucast-health".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(error) => {
                            tracing::error!(%error, "health listener failed");
                            return;
                        }
                    };
                    let router = http::health_router(state);
                    let stopped = async {
                        let _ = stopped.await;
                    };
                    // Plain HTTP: probes (httpGet) and the kubelet need no certificate.
                    accept_until(
                        listener,
                        router,
                        None,
                        Caps {
                            slots: Arc::new(Semaphore::new(HEALTH_CONNECTIONS)),
                            per_address: HEALTH_CONNECTIONS,
                        },
                        header_read,
                        stopped,
                    )
                    .await;
                });
            })?;
        tracing::info!(address = %address, "health listener ready");
        Ok(HealthListener {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for HealthListener {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Re-derives the profiles from the store every `every` (what other replicas recorded), on
/// the blocking pool; a failed refresh keeps the profiles held and is retried next time.
async fn refresh_profiles(state: AppState, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let profiles = Arc::clone(&state.engine.profiles);
        match tokio::task::spawn_blocking(move || profiles.refresh()).await {
            Ok(Ok(true)) => {
                for profile in &state.engine.profiles.list() {
                    state.engine.metrics.record_calibration(profile);
                }
                tracing::debug!("calibration profiles refreshed from the store");
            }
            Ok(Ok(false)) => {}
            Ok(Err(error)) => tracing::warn!(%error, "calibration refresh failed; profiles kept"),
            Err(error) => tracing::warn!(%error, "calibration refresh task failed"),
        }
    }
}

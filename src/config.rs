//! Command line and environment configuration.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "gpucast",
    version,
    about = "Estimates GPU memory and utilization of training jobs before they run"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once at start-up: the size of the `serve` variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the HTTP API.
    Serve(ServeConfig),
    /// Print the OpenAPI document (the committed openapi/openapi.json is this output).
    Openapi,
    /// Print the layer-kind vocabulary (the committed openapi/layer_kinds.json is this output).
    LayerKinds,
    /// Print the names each setup field takes (the committed python/src/gpucast/vocabulary.json
    /// is this output; describe/gpucast_describe/vocabulary.json links to it).
    Vocabulary,
    /// The stored calibration observations.
    #[command(subcommand)]
    Observations(ObservationsCommand),
    /// Answer a job description (the JSON of POST /v1/estimate) from the command line with the
    /// committed models, no server; bad input exits 2 with the API's problem JSON.
    Estimate(EstimateArgs),
    /// Plan a job (the JSON of POST /v1/plan from the job and flags of `estimate`): the largest
    /// micro-batch that fits each card at the job's confidence (and with --max-seq-len the
    /// longest sequence), the setups that make it fit ranked by time per sample, the smallest
    /// card. A search over the estimates `estimate` answers, no server.
    Plan(PlanArgs),
    /// Print what the estimators read of each job (the JSON of POST /v1/estimate): the raw
    /// aggregate features by name, the layers' kinds and token features; what the training
    /// pipeline learns from, so that it never restates the rules. No models needed.
    Features(FeaturesArgs),
    /// Answer a training fold's jobs by the rule a served simulated job is answered by (the
    /// correction near the data, the simulated figure far from it, the bound widened with
    /// the distance, the floor): `{"near", "far", "max_widen", "items": [...]}` in, one
    /// `{"figure_mib", "upper_bound_mib", "far"}` per item out. The simulated stage scores
    /// models it has not served yet through it, so training keeps no copy of the rule.
    Combine(CombineArgs),
    /// List the GPU catalogue: the names `--gpu` and requests take.
    Gpus {
        #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
        format: OutputFormat,
    },
}

/// How `gpucast estimate` prints its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// The API's JSON answer.
    Json,
    /// The figure, bound, fit, breakdown and step time for people.
    Table,
}

#[derive(Debug, Clone, Args)]
pub struct EstimateArgs {
    /// The job description file (JSON: a request, or a Hugging Face config.json with the setup
    /// beside its keys), or `-` for standard input. Not needed with `--config`.
    pub file: Option<String>,

    /// The setup, written into the job (over what the file says).
    #[command(flatten)]
    pub job: JobFlags,

    /// A batch: `{"items": [...]}` or a JSON array of jobs, answered as POST /v1/estimate/batch.
    #[arg(long)]
    pub batch: bool,

    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Json)]
    pub format: OutputFormat,

    /// The models, and the limits the service would hold the input to.
    #[command(flatten)]
    pub engine: OfflineArgs,

    /// Held-out score quantiles (the JSON of data/uncertainty.json) to answer with instead of
    /// the committed ones: the evaluation scores held-out sources with quantiles computed
    /// without them.
    #[arg(long)]
    pub uncertainty: Option<PathBuf>,

    /// The calibration store whose profiles move the answer: read when `--database-url` is
    /// given or the directory holds a store; otherwise no profile applies.
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, Args)]
pub struct PlanArgs {
    /// The job and how the answer is read and printed, as `gpucast estimate` takes them.
    #[command(flatten)]
    pub estimate: EstimateArgs,

    /// Plan on every card of the catalogue (`gpucast gpus`) instead of --gpu.
    #[arg(long)]
    pub catalogue: bool,

    /// A dtype sweep: precisions separated by commas (`fp32,amp_bf16,bf16`), one row each.
    #[arg(long, value_name = "LIST")]
    pub precisions: Option<String>,

    /// The largest micro-batch tried (default 4096).
    #[arg(long)]
    pub max_micro_batch: Option<u64>,

    /// Sequence length free: the longest up to this that fits at the job's micro-batch.
    #[arg(long)]
    pub max_seq_len: Option<u64>,

    /// Leave out the setups (checkpointing, LoRA, 8-bit optimizer, ZeRO-3, offload).
    #[arg(long)]
    pub no_setups: bool,
}

#[derive(Debug, Clone, Args)]
pub struct FeaturesArgs {
    /// The job file (the JSON of POST /v1/estimate), or `-` for standard input.
    pub file: String,

    /// A batch: `{"items": [...]}` or a JSON array of jobs, one result per item as
    /// `estimate --batch` answers (an item's error is its problem JSON).
    #[arg(long)]
    pub batch: bool,

    /// Largest input read, in bytes: the server's body limit, as `estimate` reads.
    #[arg(long, env = "GPUCAST_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,

    /// The most work units one job (or a `--batch`, all its jobs) may cost, as `estimate`.
    #[arg(long, env = "GPUCAST_MAX_REQUEST_COST", default_value_t = DEFAULT_MAX_REQUEST_COST)]
    pub max_request_cost: u64,
}

/// `gpucast combine`.
#[derive(Debug, Clone, Args)]
pub struct CombineArgs {
    /// The fold's jobs (JSON), or `-` for standard input.
    pub file: String,

    /// Largest input read, in bytes.
    #[arg(long, env = "GPUCAST_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
}

/// The common questions as flags: `gpucast estimate --config config.json --seq-len 2048
/// --batch-size 8 --micro-batch-size 1 --precision bf16 --lora-rank 16 --base-weights nf4
/// --gpu rtx-4090`. Each sets the request field of the same name.
#[derive(Debug, Clone, Default, Args)]
pub struct JobFlags {
    /// The setup fields whose flag is the request field itself (`--optimizer`, `--precision`,
    /// `--batch-size`, ...): declared once, in the request (`#[arg(long)]` there).
    #[command(flatten)]
    pub request: crate::api::types::EstimateRequest,
    /// A Hugging Face config.json, as the hub serves it; a directory holding one (what
    /// `save_pretrained` writes, with its adapter_config.json when there is one); or a hub repo
    /// id (`org/name`): its config.json (an adapter repo: its adapter_config.json and its
    /// base's config.json) from the local Hugging Face cache, else the hub (HF_ENDPOINT,
    /// HF_TOKEN, HF_HUB_OFFLINE). With a job file, the job's transformer_config.
    #[arg(long, value_name = "FILE|DIR|REPO")]
    pub config: Option<PathBuf>,
    /// Only this many parameters train (the rest frozen).
    #[arg(long, conflicts_with = "trainable_modules")]
    pub trainable_params: Option<u64>,
    /// Only these modules train, names separated by commas.
    #[arg(long)]
    pub trainable_modules: Option<String>,
    /// LoRA on every linear layer but the head (`--lora-targets` to name them) at this rank.
    #[arg(long)]
    pub lora_rank: Option<u64>,
    /// LoRA alpha (a scale: no memory of its own); PEFT's default, 8, when absent, as in the API
    /// and describe.
    #[arg(long, requires = "lora_rank")]
    pub lora_alpha: Option<f64>,
    /// Module names the adapters go on, separated by commas (`all-linear` by default).
    #[arg(long, requires = "lora_rank")]
    pub lora_targets: Option<String>,
    /// PEFT's lora_dropout (0 to below 1; default 0).
    #[arg(long, requires = "lora_rank")]
    pub lora_dropout: Option<f64>,
    /// PEFT's modules_to_save, names separated by commas (e.g. `embed_tokens,lm_head`).
    #[arg(long, requires = "lora_rank")]
    pub lora_modules_to_save: Option<String>,
    /// The frozen base under LoRA: same, int8, nf4, gptq_int4, awq_int4.
    #[arg(long, requires = "lora_rank")]
    pub base_weights: Option<String>,
    /// With gptq_int4 or awq_int4: inputs per quantisation group (default 128).
    #[arg(long, requires = "lora_rank")]
    pub group_size: Option<u64>,
    /// What lives in CPU memory, separated by commas: optimizer_state, gradients, parameters.
    #[arg(long, value_name = "LIST")]
    pub offload: Option<String>,
    /// How from_pretrained loaded the model, as JSON (its torch_dtype, quantization_config,
    /// attn_implementation): the request's `load`.
    #[arg(long, value_name = "FILE")]
    pub load: Option<PathBuf>,
    /// The weights' dtype from_pretrained loaded: bfloat16, float16, float32 or auto (the
    /// config's); written as `load.torch_dtype`, over --load's.
    #[arg(long)]
    pub torch_dtype: Option<String>,
    /// Per-sample input shape, dimensions separated by commas (e.g. `3,224,224`).
    #[arg(long, value_name = "DIMS")]
    pub input_shape: Option<String>,
    /// gpucast_describe's saved tensors (JSON): the request's `saved_tensors`.
    #[arg(long, value_name = "FILE")]
    pub saved_tensors: Option<PathBuf>,
    /// gpucast_describe's simulation of a step (JSON): the request's `simulation`.
    #[arg(long, value_name = "FILE")]
    pub simulation: Option<PathBuf>,
    /// The node's host memory (RAM) in MiB: an offloading job's CPU state is checked against
    /// it (`node.memory_mib`).
    #[arg(long, value_name = "MIB")]
    pub node_memory_mib: Option<u64>,
    /// The job's GPUs on one node (`node.gpus`; default: the world size, at most 8).
    #[arg(long, requires = "node_memory_mib")]
    pub node_gpus: Option<u64>,
    /// A Hugging Face Trainer's training_args.json (`TrainingArguments.to_dict()`): the
    /// micro-batch, accumulation, checkpointing, bf16/fp16 autocast and `optim`.
    #[arg(long, value_name = "FILE")]
    pub training_args: Option<PathBuf>,
    /// PEFT's adapter_config.json: the LoRA adapters.
    #[arg(long, value_name = "FILE")]
    pub adapter_config: Option<PathBuf>,
    /// A DeepSpeed config: its ZeRO stage, offload and bf16/fp16, with "auto" taken from
    /// --training-args as the Trainer takes it; the number of GPUs comes from --world-size (or the
    /// job's `parallelism.world_size`).
    #[arg(long = "deepspeed", value_name = "FILE")]
    pub deepspeed: Option<PathBuf>,
    /// accelerate's FSDP options as JSON (its config, or the fsdp_config mapping): sharding
    /// strategy, parameter offload, activation checkpointing, mixed precision and processes.
    #[arg(long = "fsdp", value_name = "FILE")]
    pub fsdp: Option<PathBuf>,
    /// A catalogue GPU (`gpucast gpus` lists them), `attached`, or a card by its name and
    /// memory (`NAME:MIB`); several separated by commas are ranked.
    #[arg(long)]
    pub gpu: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct ServeConfig {
    /// Address to listen on.
    #[arg(long, env = "GPUCAST_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// A second address answering only /healthz and /readyz, on a thread and runtime of its
    /// own with its own connection cap: probes there are answered whatever the main port is
    /// doing (its connection cap full, its workers busy). Off unless given.
    #[arg(long, env = "GPUCAST_HEALTH_LISTEN")]
    pub health_listen: Option<SocketAddr>,

    /// Directory holding manifest.json and the ONNX models it lists.
    #[arg(long, env = "GPUCAST_MODELS", default_value = "models")]
    pub models: PathBuf,

    /// ONNX Runtime shared library (libonnxruntime.so from the PyPI onnxruntime wheel;
    /// scripts/fetch-onnxruntime.sh puts it in .cache/onnxruntime/).
    #[arg(
        long,
        env = "ORT_DYLIB_PATH",
        default_value = ".cache/onnxruntime/libonnxruntime.so"
    )]
    pub ort_dylib: PathBuf,

    /// Log format.
    #[arg(long, env = "GPUCAST_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Largest request body accepted, in bytes.
    #[arg(long, env = "GPUCAST_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,

    /// Request-body bytes held at once, over every connection, charged as they arrive (each
    /// body's first 64 KiB free); a body whose next bytes would pass it is refused with 503 and
    /// Retry-After at once.
    #[arg(long, env = "GPUCAST_MAX_BODY_BYTES_IN_FLIGHT", default_value_t = 64 * 1024 * 1024)]
    pub max_body_bytes_in_flight: usize,

    /// Connections open at once; one more is closed as soon as it is accepted.
    #[arg(long, env = "GPUCAST_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,

    /// Connections open at once from one client address (an IPv6 /64 counts as one), below
    /// --max-connections so one address cannot take every connection; at most a quarter of
    /// them (and no more than 32) in a TLS handshake at once.
    #[arg(
        long,
        env = "GPUCAST_MAX_CONNECTIONS_PER_ADDRESS",
        default_value_t = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS
    )]
    pub max_connections_per_address: usize,

    /// Host names (comma-separated) that writes may carry in `Host` and `Origin` besides the
    /// loopback names of a loopback listener; a reachable listener checks them when given.
    #[arg(long, env = "GPUCAST_ALLOWED_HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,

    /// Most jobs accepted in one POST /v1/estimate/batch.
    #[arg(long, env = "GPUCAST_MAX_BATCH_ITEMS", default_value_t = DEFAULT_MAX_BATCH_ITEMS)]
    pub max_batch_items: usize,

    /// The most work one request may cost, in units of about one layer answered on one card
    /// (docs/user/guide.md, "Errors"): a request (a batch: all its items) priced above it from its
    /// sizes (layers, cards, `estimators: all`, bytes of module names, items) is refused with
    /// 422 naming the fields that make it expensive, before any work.
    #[arg(long, env = "GPUCAST_MAX_REQUEST_COST", default_value_t = DEFAULT_MAX_REQUEST_COST)]
    pub max_request_cost: u64,

    /// MiB of answers kept for reuse by their request's bytes (about 1,500 answers at the
    /// default): a body answered before is answered again without estimating while the
    /// calibration profiles it read are current (a scheduler asks about its pending jobs each
    /// cycle). 0 keeps none.
    #[arg(long, env = "GPUCAST_ANSWER_MEMO_MIB", default_value_t = 16)]
    pub answer_memo_mib: u64,

    /// Batch requests estimated at once; more wait their turn (within the request timeout). A
    /// batch runs on one core at a time: the others stay free for single estimates.
    #[arg(long, env = "GPUCAST_MAX_CONCURRENT_BATCHES", default_value_t = 1)]
    pub max_concurrent_batches: usize,

    /// ONNX Runtime sessions per model it runs (the sequence classifiers): concurrent
    /// inferences per model.
    #[arg(long, env = "GPUCAST_SESSIONS_PER_MODEL", default_value_t = 2)]
    pub sessions_per_model: usize,

    /// Requests handled at once; more are refused at once with 503 and Retry-After.
    #[arg(long, env = "GPUCAST_MAX_CONCURRENT_REQUESTS", default_value_t = 512)]
    pub max_concurrent_requests: usize,

    /// Seconds a request may take before it is answered with 503.
    #[arg(long, env = "GPUCAST_REQUEST_TIMEOUT_SECS", default_value_t = 10)]
    pub request_timeout_secs: u64,

    /// Seconds a client may take to send a request's header before the connection is closed.
    #[arg(long, env = "GPUCAST_HEADER_READ_TIMEOUT_SECS", default_value_t = 5)]
    pub header_read_timeout_secs: u64,

    /// Seconds a client may take to send a request's body (read before the request takes a
    /// slot) before it is answered 408.
    #[arg(long, env = "GPUCAST_BODY_READ_TIMEOUT_SECS", default_value_t = 5)]
    pub body_read_timeout_secs: u64,

    /// Seconds a shutdown waits for connections to finish before closing them.
    #[arg(long, env = "GPUCAST_DRAIN_TIMEOUT_SECS", default_value_t = 20)]
    pub drain_timeout_secs: u64,

    /// Directory of the calibration store: the SQLite database of observations
    /// (gpucast.sqlite3, WAL), created if missing; by default under the user's data home
    /// ($XDG_DATA_HOME/gpucast, else ~/.local/share/gpucast), never the working directory. Unused with --database-url. Profile files of
    /// former versions (<gpu>.json, from --profiles) found here are imported into an empty
    /// database.
    #[arg(
        long,
        alias = "profiles",
        env = "GPUCAST_STORE_DIR",
        default_value_os_t = default_data_dir()
    )]
    pub data_dir: PathBuf,

    /// PostgreSQL URL (postgres://user:password@host:5432/db) of the calibration store, shared
    /// by any number of replicas; SQLite under --data-dir when absent. Redacted in logs.
    #[arg(long, env = "GPUCAST_DATABASE_URL")]
    pub database_url: Option<DatabaseUrl>,

    /// Seconds between refreshes of the in-memory profiles from the store (to serve what
    /// other replicas recorded); a refresh also follows every write of this process.
    #[arg(long, env = "GPUCAST_PROFILE_REFRESH_SECS", default_value_t = 5)]
    pub profile_refresh_secs: u64,

    /// Observations kept per GPU and environment (the newest).
    #[arg(long, env = "GPUCAST_MAX_OBSERVATIONS_PER_KEY", default_value_t = crate::calibration::store::DEFAULT_RETENTION.per_key)]
    pub max_observations_per_key: usize,

    /// Observations kept in all (the oldest are dropped first).
    #[arg(long, env = "GPUCAST_MAX_OBSERVATIONS", default_value_t = crate::calibration::store::DEFAULT_RETENTION.total)]
    pub max_observations: usize,

    /// Bytes of stored observations (their jobs as posted, breakdowns, step-time curves) kept
    /// in all (the oldest are dropped first).
    #[arg(long, env = "GPUCAST_MAX_STORE_BYTES", default_value_t = crate::calibration::store::DEFAULT_RETENTION.bytes)]
    pub max_store_bytes: u64,

    /// Bearer token required by the routes that change state (calibration); none means open.
    #[arg(long, env = "GPUCAST_TOKEN")]
    pub token: Option<ApiToken>,

    /// Processes watched at once (POST /v1/calibration/watch); more are refused with 429.
    #[arg(long, env = "GPUCAST_MAX_WATCHES", default_value_t = 64)]
    pub max_watches: usize,

    /// Do not look for NVIDIA GPUs through NVML (as if the host had none).
    #[arg(long, env = "GPUCAST_NO_NVML")]
    pub no_nvml: bool,

    /// A JSON GPU catalogue in the format of data/gpus.json: its entries are added to the
    /// built-in ones, or replace those with the same id. Checked at start-up.
    #[arg(long, env = "GPUCAST_GPUS")]
    pub gpus: Option<PathBuf>,

    /// Answer POST /v1/kubernetes/admission, the Kubernetes mutating admission webhook (it
    /// sets a node affinity on the GPU products a job fits); 404 unless given.
    #[arg(long, env = "GPUCAST_ADMISSION")]
    pub admission: bool,

    /// The GPU products this cluster's nodes carry, as GPU Feature Discovery labels them
    /// (`nvidia.com/gpu.product`, comma-separated: `NVIDIA-A100-SXM4-80GB,NVIDIA-H100-80GB-HBM3`;
    /// `gpucast gpus --format json` lists each card's): the admission webhook's affinity names
    /// only these. Every catalogued product when absent.
    #[arg(
        long,
        env = "GPUCAST_ADMISSION_PRODUCTS",
        value_delimiter = ',',
        requires = "admission"
    )]
    pub admission_products: Vec<String>,

    /// A PEM certificate chain to serve HTTPS with (with --tls-key); Kubernetes calls webhooks
    /// over TLS only. Plain HTTP when absent.
    #[arg(long, env = "GPUCAST_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// The PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "GPUCAST_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

/// The largest request body, bytes (`--max-body-bytes`; `gpucast estimate` reads no more).
pub const DEFAULT_MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

/// The default of --max-connections-per-address: a quarter of the default --max-connections.
pub const DEFAULT_MAX_CONNECTIONS_PER_ADDRESS: usize = 256;
/// Jobs in one batch (`--max-batch-items`; `gpucast estimate --batch` too).
pub const DEFAULT_MAX_BATCH_ITEMS: usize = 256;
/// The most work units one request may cost (`--max-request-cost`; `gpucast estimate` too):
/// about 1 s of CPU on the 2-core machine the units were measured on (a unit is about 0.1 us
/// there: `crate::engine::cost`). Each job the repository sends is priced under a hundredth of
/// it, a full batch of the dearest of them under three fifths (`tests/api/cost.rs`); the
/// dearest body the other limits let through (256 printouts of 4,095 layers, each ranked on 16
/// cards with the classifiers) is priced at 118 million.
pub const DEFAULT_MAX_REQUEST_COST: u64 = 10_000_000;

/// Where a relative path of the committed files (`models`, `.cache/onnxruntime/...`) is:
/// the working directory when it is there; else beside the executable (an installed copy
/// with `models/` and `.cache/` put next to it); else the checkout the binary was built from
/// (`cargo install --path .` keeps working from any directory while the checkout stays).
/// The path as given when none holds it, so that errors name what was asked for.
pub fn located(path: &Path) -> PathBuf {
    if path.is_absolute() || path.exists() {
        return path.to_path_buf();
    }
    let beside_executable = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(path)));
    let in_checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    beside_executable
        .into_iter()
        .chain(std::iter::once(in_checkout))
        .find(|candidate| candidate.exists())
        .unwrap_or_else(|| path.to_path_buf())
}

/// A database URL whose password never appears in logs or debug output.
#[derive(Clone, PartialEq, Eq)]
pub struct DatabaseUrl(String);

impl DatabaseUrl {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DatabaseUrl({})",
            crate::calibration::db::redact(&self.0)
        )
    }
}

impl std::str::FromStr for DatabaseUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            Ok(DatabaseUrl(s.to_string()))
        } else {
            Err("must be a postgres:// or postgresql:// URL".into())
        }
    }
}

/// The store's default directory: `$XDG_DATA_HOME/gpucast`, else `~/.local/share/gpucast`
/// (the XDG base directories), else `gpucast-data` in the working directory when neither
/// variable is set.
pub fn default_data_dir() -> PathBuf {
    let absolute = |var: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    absolute("XDG_DATA_HOME")
        .or_else(|| absolute("HOME").map(|home| home.join(".local").join("share")))
        .map_or_else(
            || PathBuf::from("gpucast-data"),
            |data| data.join("gpucast"),
        )
}

/// Where `gpucast observations export` reads.
#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    /// Directory of the SQLite store (as `serve --data-dir`).
    #[arg(
        long,
        alias = "profiles",
        env = "GPUCAST_STORE_DIR",
        default_value_os_t = default_data_dir()
    )]
    pub data_dir: PathBuf,

    /// PostgreSQL URL of the store (as `serve --database-url`).
    #[arg(long, env = "GPUCAST_DATABASE_URL")]
    pub database_url: Option<DatabaseUrl>,
}

/// `gpucast observations ...`.
#[derive(Debug, Subcommand)]
pub enum ObservationsCommand {
    /// Write the stored observations as JSON Lines (one observation a line: id, recorded_at,
    /// gpu, environment, job, observed_peak_mib, predicted_mib, breakdown, source), oldest
    /// first: extra training data for training/ (`--observations FILE`).
    Export {
        #[command(flatten)]
        store: StoreArgs,
        /// File to write (replaced); standard output when absent.
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// Record observations (one, or a JSON array, as POST /v1/calibration/observations takes
    /// them) into the store, held to the service's rules: what the route refuses, this
    /// refuses, recording nothing; else all are recorded and the refitted profiles printed.
    Record(RecordArgs),
}

/// What a command answering without a server loads, and the limits the service would hold
/// its input to, so that what the command answers the service would take too.
#[derive(Debug, Clone, Args)]
pub struct OfflineArgs {
    /// Directory holding manifest.json and the ONNX models it lists.
    #[arg(long, env = "GPUCAST_MODELS", default_value = "models")]
    pub models: PathBuf,

    /// ONNX Runtime shared library.
    #[arg(
        long,
        env = "ORT_DYLIB_PATH",
        default_value = ".cache/onnxruntime/libonnxruntime.so"
    )]
    pub ort_dylib: PathBuf,

    /// Largest input read, in bytes: the server's body limit, so that what the command
    /// answers the service would take too.
    #[arg(long, env = "GPUCAST_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,

    /// The most work units one job (or a `--batch`, all its jobs, or a file of observations)
    /// may cost: the server's budget (`serve --max-request-cost`).
    #[arg(long, env = "GPUCAST_MAX_REQUEST_COST", default_value_t = DEFAULT_MAX_REQUEST_COST)]
    pub max_request_cost: u64,
}

/// `gpucast observations record`.
#[derive(Debug, clap::Args)]
pub struct RecordArgs {
    /// The observations file (JSON), or `-` for standard input.
    pub file: String,

    /// The models, and the limits the service would hold the input to.
    #[command(flatten)]
    pub engine: OfflineArgs,

    /// The store written (created in --data-dir when absent).
    #[command(flatten)]
    pub store: StoreArgs,
}

/// A secret that never appears in logs or debug output.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiToken(String);

impl ApiToken {
    pub fn new(token: impl Into<String>) -> ApiToken {
        ApiToken(token.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken(redacted)")
    }
}

impl std::str::FromStr for ApiToken {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().is_empty() {
            Err("the token must not be empty".into())
        } else {
            Ok(ApiToken(s.to_string()))
        }
    }
}

impl ServeConfig {
    /// Rejects impossible combinations before anything starts.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("--max-body-bytes", self.max_body_bytes),
            ("--max-batch-items", self.max_batch_items),
            (
                "--max-request-cost",
                self.max_request_cost.min(usize::MAX as u64) as usize,
            ),
            ("--max-body-bytes-in-flight", self.max_body_bytes_in_flight),
            ("--max-connections", self.max_connections),
            (
                "--max-connections-per-address",
                self.max_connections_per_address,
            ),
            ("--max-concurrent-batches", self.max_concurrent_batches),
            ("--sessions-per-model", self.sessions_per_model),
            ("--max-concurrent-requests", self.max_concurrent_requests),
            ("--request-timeout-secs", self.request_timeout_secs as usize),
            (
                "--header-read-timeout-secs",
                self.header_read_timeout_secs as usize,
            ),
            (
                "--body-read-timeout-secs",
                self.body_read_timeout_secs as usize,
            ),
            ("--drain-timeout-secs", self.drain_timeout_secs as usize),
            ("--max-watches", self.max_watches),
            ("--profile-refresh-secs", self.profile_refresh_secs as usize),
            ("--max-observations-per-key", self.max_observations_per_key),
            ("--max-observations", self.max_observations),
            (
                "--max-store-bytes",
                self.max_store_bytes.min(usize::MAX as u64) as usize,
            ),
        ];
        for (flag, value) in positive {
            if value == 0 {
                return Err(format!("{flag} must be positive"));
            }
        }
        if self.max_body_bytes_in_flight < self.max_body_bytes {
            return Err(
                "--max-body-bytes-in-flight must hold at least one --max-body-bytes body".into(),
            );
        }
        Ok(())
    }

    /// A configuration for tests and benchmarks: ephemeral port, repository models, a fresh
    /// profiles directory, no NVML.
    pub fn for_tests(models: PathBuf, ort_dylib: PathBuf) -> ServeConfig {
        ServeConfig {
            listen: "127.0.0.1:0".parse().expect("valid address"),
            health_listen: None,
            models,
            ort_dylib,
            log_format: LogFormat::Text,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_body_bytes_in_flight: 64 * 1024 * 1024,
            max_connections: 1024,
            max_connections_per_address: DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
            allowed_hosts: Vec::new(),
            max_batch_items: DEFAULT_MAX_BATCH_ITEMS,
            max_request_cost: DEFAULT_MAX_REQUEST_COST,
            answer_memo_mib: 16,
            max_concurrent_batches: 1,
            sessions_per_model: 2,
            max_concurrent_requests: 512,
            request_timeout_secs: 10,
            header_read_timeout_secs: 5,
            body_read_timeout_secs: 5,
            drain_timeout_secs: 20,
            data_dir: std::env::temp_dir().join(format!(
                "gpucast-data-{}-{}",
                std::process::id(),
                unique()
            )),
            database_url: None,
            profile_refresh_secs: 5,
            max_observations_per_key: crate::calibration::store::DEFAULT_RETENTION.per_key,
            max_observations: crate::calibration::store::DEFAULT_RETENTION.total,
            max_store_bytes: crate::calibration::store::DEFAULT_RETENTION.bytes,
            token: None,
            max_watches: 64,
            no_nvml: true,
            gpus: None,
            admission: false,
            admission_products: Vec::new(),
            tls_cert: None,
            tls_key: None,
        }
    }
}

/// A number unique within this process, for test directories.
fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_redacted_in_debug_output_and_must_not_be_empty() {
        let token: ApiToken = "s3cret".parse().unwrap();
        assert!(!format!("{token:?}").contains("s3cret"));
        assert!("  ".parse::<ApiToken>().is_err());
    }
}

//! Every Prometheus metric of the service, defined once. Each app owns its registry, so tests
//! can run several apps in one process.
//!
//! | metric | type | labels |
//! | --- | --- | --- |
//! | `gpucast_http_requests_total` | counter | method, route (template), status |
//! | `gpucast_http_request_duration_seconds` | histogram | method, route, status |
//! | `gpucast_inference_duration_seconds` | histogram | estimator |
//! | `gpucast_predicted_class_total` | counter | family, class (index of the combined class) |
//! | `gpucast_answers_reused_total` | counter | (none): answers given again without estimating (a body answered before while the profiles it read are current, or a batch item repeating an earlier one) |
//! | `gpucast_cancelled_total` | counter | work (`estimate`, `batch`), stage (`queued`: not started before its deadline; `running`: stopped at it) |
//! | `gpucast_admission_decisions_total` | counter | decision (`placed`: allowed with a node affinity; `allowed`: allowed as it is; `denied`) |
//! | `gpucast_build_info` | gauge (1) | version, estimators (manifest generation time) |
//! | `gpucast_calibration_observations` | gauge | gpu (profile key), environment (`""`: the GPU's own profile) |
//! | `gpucast_calibration_scale` | gauge | gpu, environment |
//! | `gpucast_calibration_offset_mib` | gauge | gpu, environment |
//! | `gpucast_calibration_host_us_per_op` | gauge | gpu, environment (profiles with observed step times) |
//! | `gpucast_calibration_observed_over_estimated` | histogram | gpu, environment: each recorded observation's peak over the service's uncalibrated figure for its job |
//!
//! The calibration labels are bounded: catalogued and attached cards, at most 256 custom
//! ones, each with at most 32 environments.

use crate::calibration::profile::CalibrationProfile;
use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// HTTP latency buckets, seconds: estimates take tens of microseconds, batches milliseconds.
const HTTP_BUCKETS: [f64; 14] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];
/// Observed / estimated buckets: a few % either side of 1, then the stacks that hold up to 2x
/// more or less (calibration's factor range) and beyond.
const RATIO_BUCKETS: [f64; 17] = [
    0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.5, 1.75, 2.0, 3.0,
];
/// Inference latency buckets, seconds: from a few microseconds (MLP) to a millisecond or so.
const INFERENCE_BUCKETS: [f64; 12] = [
    0.000002, 0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
    0.01,
];

/// The decisions an admission review is counted under.
pub const ADMISSION_DECISIONS: [&str; 3] = ["placed", "allowed", "denied"];

pub struct Metrics {
    registry: Registry,
    pub http_requests_total: IntCounterVec,
    pub http_request_duration_seconds: HistogramVec,
    pub inference_duration_seconds: HistogramVec,
    pub predicted_class_total: IntCounterVec,
    pub answers_reused_total: IntCounter,
    pub cancelled_total: IntCounterVec,
    pub admission_decisions_total: IntCounterVec,
    pub build_info: IntGaugeVec,
    pub calibration_observations: IntGaugeVec,
    pub calibration_scale: GaugeVec,
    pub calibration_offset_mib: GaugeVec,
    pub calibration_host_us_per_op: GaugeVec,
    pub calibration_observed_over_estimated: HistogramVec,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new_custom(Some("gpucast".into()), None).expect("valid prefix");
        let http_requests_total = IntCounterVec::new(
            Opts::new("http_requests_total", "HTTP requests answered"),
            &["method", "route", "status"],
        )
        .expect("valid metric");
        let http_request_duration_seconds = HistogramVec::new(
            HistogramOpts::new("http_request_duration_seconds", "HTTP request latency")
                .buckets(HTTP_BUCKETS.to_vec()),
            &["method", "route", "status"],
        )
        .expect("valid metric");
        let inference_duration_seconds = HistogramVec::new(
            HistogramOpts::new(
                "inference_duration_seconds",
                "Time one estimator takes for one job",
            )
            .buckets(INFERENCE_BUCKETS.to_vec()),
            &["estimator"],
        )
        .expect("valid metric");
        let predicted_class_total = IntCounterVec::new(
            Opts::new("predicted_class_total", "Combined memory classes predicted"),
            &["family", "class"],
        )
        .expect("valid metric");
        let answers_reused_total = IntCounter::new(
            "answers_reused_total",
            "Answers given again without estimating: kept ones, and batch items repeating another",
        )
        .expect("valid metric");
        let cancelled_total = IntCounterVec::new(
            Opts::new(
                "cancelled_total",
                "Estimate work stopped at its request's deadline (the request answered 503)",
            ),
            &["work", "stage"],
        )
        .expect("valid metric");
        let admission_decisions_total = IntCounterVec::new(
            Opts::new(
                "admission_decisions_total",
                "Admission reviews answered, by decision (denials are HTTP 200 reviews)",
            ),
            &["decision"],
        )
        .expect("valid metric");
        // Every decision's series from the start, at 0: a dashboard's rate needs them.
        for decision in ADMISSION_DECISIONS {
            admission_decisions_total.with_label_values(&[decision]);
        }
        let build_info = IntGaugeVec::new(
            Opts::new("build_info", "Build and model information (always 1)"),
            &["version", "estimators"],
        )
        .expect("valid metric");
        let calibration_observations = IntGaugeVec::new(
            Opts::new(
                "calibration_observations",
                "Observations behind each calibration profile (a GPU's, or a GPU's in an environment)",
            ),
            &["gpu", "environment"],
        )
        .expect("valid metric");
        let calibration_scale = GaugeVec::new(
            Opts::new("calibration_scale", "Scale of each calibration profile"),
            &["gpu", "environment"],
        )
        .expect("valid metric");
        let calibration_offset_mib = GaugeVec::new(
            Opts::new(
                "calibration_offset_mib",
                "Offset (MiB) of each calibration profile",
            ),
            &["gpu", "environment"],
        )
        .expect("valid metric");
        let calibration_host_us_per_op = GaugeVec::new(
            Opts::new(
                "calibration_host_us_per_op",
                "Host time per dispatched op (us) fitted to each profile's observed step times",
            ),
            &["gpu", "environment"],
        )
        .expect("valid metric");
        let calibration_observed_over_estimated = HistogramVec::new(
            HistogramOpts::new(
                "calibration_observed_over_estimated",
                "Each recorded observation's peak over the service's uncalibrated figure for its job",
            )
            .buckets(RATIO_BUCKETS.to_vec()),
            &["gpu", "environment"],
        )
        .expect("valid metric");
        for collector in [
            Box::new(http_requests_total.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(http_request_duration_seconds.clone()),
            Box::new(inference_duration_seconds.clone()),
            Box::new(predicted_class_total.clone()),
            Box::new(answers_reused_total.clone()),
            Box::new(cancelled_total.clone()),
            Box::new(admission_decisions_total.clone()),
            Box::new(build_info.clone()),
            Box::new(calibration_observations.clone()),
            Box::new(calibration_scale.clone()),
            Box::new(calibration_offset_mib.clone()),
            Box::new(calibration_host_us_per_op.clone()),
            Box::new(calibration_observed_over_estimated.clone()),
        ] {
            registry
                .register(collector)
                .expect("each metric is registered once");
        }
        Metrics {
            registry,
            http_requests_total,
            http_request_duration_seconds,
            inference_duration_seconds,
            predicted_class_total,
            answers_reused_total,
            cancelled_total,
            admission_decisions_total,
            build_info,
            calibration_observations,
            calibration_scale,
            calibration_offset_mib,
            calibration_host_us_per_op,
            calibration_observed_over_estimated,
        }
    }

    /// Counts one answer of `family` in combined memory class `class`
    /// (`gpucast_predicted_class_total`).
    pub fn count_class(&self, family: &str, class: usize) {
        self.predicted_class_total
            .with_label_values(&[family, &class.to_string()])
            .inc();
    }

    /// Publishes the state of one calibration profile (a GPU's own, or a GPU's in an
    /// environment).
    pub fn record_calibration(&self, profile: &CalibrationProfile) {
        let labels = [
            profile.sku.as_str(),
            profile.environment.as_deref().unwrap_or(""),
        ];
        self.calibration_observations
            .with_label_values(&labels)
            .set(profile.observations as i64);
        self.calibration_scale
            .with_label_values(&labels)
            .set(profile.scale);
        self.calibration_offset_mib
            .with_label_values(&labels)
            .set(profile.offset_mib);
        if let Some(fit) = profile.host_fit {
            self.calibration_host_us_per_op
                .with_label_values(&labels)
                .set(fit.host_us_per_op);
        }
    }

    /// Counts one admission review's decision: `placed` (allowed with a patch), `allowed` (as
    /// it is) or `denied`.
    pub fn record_admission(&self, allowed: bool, patched: bool) {
        let decision = match (allowed, patched) {
            (false, _) => "denied",
            (true, true) => "placed",
            (true, false) => "allowed",
        };
        self.admission_decisions_total
            .with_label_values(&[decision])
            .inc();
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .expect("encoding to memory succeeds");
        String::from_utf8(buffer).expect("the text format is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

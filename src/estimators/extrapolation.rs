//! The training domain of the regressors that correct the simulated figure, and how far a job
//! stands from it.
//!
//! A learned correction is only as good as the data it was fitted on: the training pipeline
//! writes the normalised feature vectors of its training jobs (`simulated_domain.json`, named
//! by the manifest's `simulated.domain`), and a job's distance to the nearest of them, over
//! the distance typical of a family the regressor had not seen, says whether the correction
//! may be trusted there. What follows from that distance is decided in [`super::combine`].

use std::collections::HashSet;

use serde::Deserialize;

use crate::estimators::features::{AggregateFeatures, FeatureSpec};
use crate::job::{Job, Optimizer, Precision};

/// `simulated_domain.json` as the training pipeline writes it (docs/design/models.md).
#[derive(Debug, Deserialize)]
struct DomainFile {
    /// How each coordinate is normalised: the ONNX inputs' `{name, transform, mean, std}`.
    features: Vec<FeatureSpec>,
    /// The feature name of each coordinate of `points`, in order.
    order: Vec<String>,
    optimizers: Vec<String>,
    precisions: Vec<String>,
    /// The distance that counts as 1 (the pipeline: the 95th percentile, over its training
    /// jobs, of the distance to the nearest job of another model family).
    typical_distance: f64,
    near: f64,
    far: f64,
    max_widen: f64,
    /// The training jobs' normalised vectors, one per job, coordinates in `order`.
    points: Vec<Vec<f64>>,
}

/// Where a job stands against the training domain.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Extrapolation {
    /// Euclidean distance from the job's normalised vector to the nearest training job's;
    /// `None` when the job is outside the domain's setups (no distance is measured then).
    pub distance: Option<f64>,
    pub typical_distance: f64,
    /// `distance / typical_distance`; infinite outside the domain's setups.
    pub ratio: f64,
    /// The job's optimizer or precision is not one the regressor was trained on.
    pub outside_setup: bool,
    /// The domain's thresholds, carried for the rule in [`super::combine`].
    pub near: f64,
    pub far: f64,
    pub max_widen: f64,
}

/// The loaded and checked training domain.
#[derive(Debug)]
pub struct TrainingDomain {
    /// The normalisation of each coordinate, in the order of the points' coordinates.
    specs: Vec<FeatureSpec>,
    optimizers: Vec<Optimizer>,
    precisions: Vec<Precision>,
    typical_distance: f64,
    near: f64,
    far: f64,
    max_widen: f64,
    points: Points,
}

/// What GET /v1/estimators shows of a loaded domain.
#[derive(Debug, Clone, PartialEq)]
pub struct DomainSummary {
    pub points: usize,
    pub features: Vec<String>,
    pub optimizers: Vec<String>,
    pub precisions: Vec<String>,
    pub typical_distance: f64,
    pub near: f64,
    pub far: f64,
    pub max_widen: f64,
}

impl TrainingDomain {
    /// Parses and checks a domain file. `known` says whether an aggregate feature name is one
    /// this build computes. The error is one line, for a message that names the file.
    pub fn parse(bytes: &[u8], known: impl Fn(&str) -> bool) -> Result<TrainingDomain, String> {
        let file: DomainFile = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        crate::estimators::features::check_specs(&file.features, known)?;
        let mut names = HashSet::new();
        if let Some(duplicate) = file
            .features
            .iter()
            .find(|spec| !names.insert(spec.name.as_str()))
        {
            return Err(format!("feature '{}' is listed twice", duplicate.name));
        }
        if file.order.is_empty() {
            return Err("order is empty".into());
        }
        let mut ordered = HashSet::new();
        if let Some(duplicate) = file
            .order
            .iter()
            .find(|name| !ordered.insert(name.as_str()))
        {
            return Err(format!("order lists '{duplicate}' twice"));
        }
        let specs = file
            .order
            .iter()
            .map(|name| {
                file.features
                    .iter()
                    .find(|spec| &spec.name == name)
                    .cloned()
                    .ok_or_else(|| format!("order names '{name}', which features do not describe"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(extra) = file
            .features
            .iter()
            .find(|spec| !ordered.contains(spec.name.as_str()))
        {
            return Err(format!(
                "feature '{}' is described but not in order",
                extra.name
            ));
        }
        let optimizers = parse_all(&file.optimizers, "optimizers", Optimizer::parse)?;
        let precisions = parse_all(&file.precisions, "precisions", Precision::parse)?;
        if !(file.typical_distance.is_finite() && file.typical_distance > 0.0) {
            return Err(format!(
                "typical_distance must be a positive number, got {}",
                file.typical_distance
            ));
        }
        if !(file.near.is_finite()
            && file.far.is_finite()
            && 0.0 < file.near
            && file.near <= file.far)
        {
            return Err(format!(
                "near and far must be numbers with 0 < near <= far, got near {} and far {}",
                file.near, file.far
            ));
        }
        if !(file.max_widen.is_finite() && file.max_widen >= 1.0) {
            return Err(format!(
                "max_widen must be a number of at least 1, got {}",
                file.max_widen
            ));
        }
        if file.points.is_empty() {
            return Err("points is empty".into());
        }
        for (i, point) in file.points.iter().enumerate() {
            if point.len() != specs.len() {
                return Err(format!(
                    "points[{i}] has {} coordinates, order has {}",
                    point.len(),
                    specs.len()
                ));
            }
            if let Some(d) = point.iter().position(|v| !v.is_finite()) {
                return Err(format!("points[{i}][{d}] is not a finite number"));
            }
        }
        Ok(TrainingDomain {
            points: Points::new(&file.points, specs.len()),
            specs,
            optimizers,
            precisions,
            typical_distance: file.typical_distance,
            near: file.near,
            far: file.far,
            max_widen: file.max_widen,
        })
    }

    /// Where `job` (with `aggregate` its features) stands: outside when its optimizer or
    /// precision is not the domain's (a distance in features cannot tell how another optimizer
    /// changes memory), else its distance to the nearest training job.
    pub fn locate(&self, job: &Job, aggregate: &AggregateFeatures) -> Extrapolation {
        let outside_setup = !(self.optimizers.contains(&job.optimizer())
            && self.precisions.contains(&job.precision())
            && job.learned_estimators_apply());
        let distance = if outside_setup {
            None
        } else {
            // A non-finite coordinate (no such job passes validation) is as far as can be.
            Some(self.nearest_distance(&self.vector(aggregate))).filter(|d| d.is_finite())
        };
        Extrapolation {
            distance,
            typical_distance: self.typical_distance,
            ratio: distance.map_or(f64::INFINITY, |d| d / self.typical_distance),
            outside_setup,
            near: self.near,
            far: self.far,
            max_widen: self.max_widen,
        }
    }

    /// The job's normalised vector, coordinates in the points' order.
    pub fn vector(&self, aggregate: &AggregateFeatures) -> Vec<f64> {
        // Names were checked against `AggregateFeatures::get` at load.
        self.specs
            .iter()
            .map(|spec| spec.normalise(aggregate.get(&spec.name).unwrap_or(0.0)))
            .collect()
    }

    /// Euclidean distance from `vector` to the nearest training point.
    pub fn nearest_distance(&self, vector: &[f64]) -> f64 {
        self.points.nearest_squared(vector).sqrt()
    }

    pub fn summary(&self) -> DomainSummary {
        DomainSummary {
            points: self.points.len,
            features: self.specs.iter().map(|s| s.name.clone()).collect(),
            optimizers: self
                .optimizers
                .iter()
                .map(|o| o.as_str().to_string())
                .collect(),
            precisions: self
                .precisions
                .iter()
                .map(|p| p.as_str().to_string())
                .collect(),
            typical_distance: self.typical_distance,
            near: self.near,
            far: self.far,
            max_widen: self.max_widen,
        }
    }
}

fn parse_all<T>(
    names: &[String],
    field: &str,
    parse: fn(&str) -> Option<T>,
) -> Result<Vec<T>, String> {
    if names.is_empty() {
        return Err(format!(
            "{field} is empty: no job would be inside the domain"
        ));
    }
    names
        .iter()
        .map(|name| parse(name).ok_or_else(|| format!("{field}: unknown '{name}'")))
        .collect()
}

/// Points per block: a block's running sums stay in registers.
const LANES: usize = 16;

/// The training points, laid out for a brute-force nearest-neighbour search: blocks of
/// [`LANES`] points, each block coordinate-major (`LANES` first coordinates, then `LANES`
/// second ones, ...), so that the compiler vectorises across points (twice as fast as a scan
/// point by point). Brute force over 3,000 points of 11 coordinates takes about 10 us
/// (`cargo bench`) and is exact; a k-d tree gains little where the number of points is barely
/// above 2^dimensions.
#[derive(Debug)]
struct Points {
    dims: usize,
    len: usize,
    /// `blocks[b * dims + d][j]`: coordinate d of point `b * LANES + j`; the last block is
    /// padded with infinite coordinates, which are never nearest.
    blocks: Vec<[f64; LANES]>,
}

impl Points {
    fn new(rows: &[Vec<f64>], dims: usize) -> Points {
        let n_blocks = rows.len().div_ceil(LANES);
        let mut blocks = vec![[f64::INFINITY; LANES]; n_blocks * dims];
        for (i, row) in rows.iter().enumerate() {
            for (d, &value) in row.iter().enumerate() {
                blocks[(i / LANES) * dims + d][i % LANES] = value;
            }
        }
        Points {
            dims,
            len: rows.len(),
            blocks,
        }
    }

    /// The smallest squared distance from `query` (`dims` coordinates) to a point.
    fn nearest_squared(&self, query: &[f64]) -> f64 {
        debug_assert_eq!(query.len(), self.dims);
        let mut best = [f64::INFINITY; LANES];
        for block in self.blocks.chunks_exact(self.dims) {
            let mut sums = [0.0f64; LANES];
            for (column, &q) in block.iter().zip(query) {
                for (sum, &p) in sums.iter_mut().zip(column) {
                    let d = p - q;
                    *sum += d * d;
                }
            }
            for (b, s) in best.iter_mut().zip(sums) {
                if s < *b {
                    *b = s;
                }
            }
        }
        best.into_iter().fold(f64::INFINITY, f64::min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn spec(name: &str) -> Value {
        json!({"name": name, "transform": "log1p", "mean": 1.0, "std": 2.0})
    }

    fn file() -> Value {
        json!({
            // Described in another order than the points' coordinates.
            "features": [spec("total_params"), {"name": "batch_size", "transform": "identity", "mean": 10.0, "std": 5.0}],
            "order": ["batch_size", "total_params"],
            "optimizers": ["adam"], "precisions": ["fp32"],
            "typical_distance": 0.5, "near": 1.0, "far": 2.0, "max_widen": 2.0,
            "points": [[0.0, 0.0], [1.0, 1.0], [-2.0, 3.0]]
        })
    }

    fn parse(file: &Value) -> Result<TrainingDomain, String> {
        TrainingDomain::parse(file.to_string().as_bytes(), |name| {
            AggregateFeatures::of(&job(1)).get(name).is_some()
        })
    }

    fn job(batch: u64) -> Job {
        let layers = [crate::job::UncheckedLayer {
            kind: "linear",
            output_size: 10,
            params: 1000,
        }];
        Job::parse(None, batch, layers.into_iter()).unwrap()
    }

    /// A plain scan, the definition the blocked layout must reproduce.
    fn naive(points: &[Vec<f64>], q: &[f64]) -> f64 {
        points
            .iter()
            .map(|p| p.iter().zip(q).map(|(a, b)| (a - b) * (a - b)).sum::<f64>())
            .fold(f64::INFINITY, f64::min)
            .sqrt()
    }

    #[test]
    fn the_nearest_distance_is_exact_whatever_the_number_of_points() {
        // A deterministic spread of points; counts around the block size and a realistic one.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 20_000) as f64 / 1000.0 - 10.0
        };
        for (n, dims) in [(1, 1), (15, 3), (16, 11), (17, 11), (100, 11), (3000, 11)] {
            let rows: Vec<Vec<f64>> = (0..n)
                .map(|_| (0..dims).map(|_| next()).collect())
                .collect();
            let points = Points::new(&rows, dims);
            for _ in 0..20 {
                let q: Vec<f64> = (0..dims).map(|_| next()).collect();
                let expected = naive(&rows, &q);
                assert!(
                    (points.nearest_squared(&q).sqrt() - expected).abs() < 1e-12,
                    "{n} x {dims}"
                );
            }
            // At a training point: exactly 0.
            assert_eq!(points.nearest_squared(&rows[n - 1]), 0.0);
        }
    }

    #[test]
    fn a_job_is_placed_by_its_vector_in_the_order_of_the_points() {
        let domain = parse(&file()).unwrap();
        let aggregate = AggregateFeatures::of(&job(10));
        // batch 10: identity (10 - 10) / 5 = 0; 1000 params: (ln 1001 - 1) / 2.
        let vector = domain.vector(&aggregate);
        assert_eq!(vector[0], 0.0);
        assert!((vector[1] - (1001f64.ln() - 1.0) / 2.0).abs() < 1e-12);
        let placed = domain.locate(&job(10), &aggregate);
        let nearest = naive(&[vec![0.0, 0.0], vec![1.0, 1.0], vec![-2.0, 3.0]], &vector);
        assert_eq!(placed.distance, Some(nearest));
        assert!((placed.ratio - nearest / 0.5).abs() < 1e-12);
        assert!(!placed.outside_setup);
    }

    #[test]
    fn another_optimizer_or_precision_is_outside_the_domain() {
        let domain = parse(&file()).unwrap();
        for (optimizer, precision) in [("sgd", "fp32"), ("adamw", "fp32"), ("adam", "bf16")] {
            let job = job(10)
                .with_training(Some(optimizer), Some(precision))
                .unwrap();
            let placed = domain.locate(&job, &AggregateFeatures::of(&job));
            assert_eq!(
                (placed.distance, placed.ratio, placed.outside_setup),
                (None, f64::INFINITY, true),
                "{optimizer} {precision}"
            );
        }
    }

    #[test]
    fn a_domain_file_that_does_not_hold_is_refused_saying_why() {
        type Edit = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(&str, Edit, &str)> = vec![
            (
                "short point",
                Box::new(|f| f["points"][1] = json!([1.0])),
                "points[1] has 1 coordinates, order has 2",
            ),
            (
                "long point",
                Box::new(|f| f["points"][2] = json!([1.0, 2.0, 3.0])),
                "points[2] has 3 coordinates",
            ),
            (
                "no points",
                Box::new(|f| f["points"] = json!([])),
                "points is empty",
            ),
            (
                "unknown feature",
                Box::new(|f| f["features"][0]["name"] = "params_squared".into()),
                "unknown feature 'params_squared'",
            ),
            (
                "order without features",
                Box::new(|f| f["order"] = json!(["batch_size", "n_layers"])),
                "order names 'n_layers'",
            ),
            (
                "feature not in order",
                Box::new(|f| f["order"] = json!(["batch_size"])),
                "feature 'total_params' is described but not in order",
            ),
            (
                "order twice",
                Box::new(|f| f["order"] = json!(["batch_size", "batch_size"])),
                "order lists 'batch_size' twice",
            ),
            (
                "zero std",
                Box::new(|f| f["features"][1]["std"] = 0.0.into()),
                "invalid mean/std",
            ),
            (
                "zero typical distance",
                Box::new(|f| f["typical_distance"] = 0.0.into()),
                "typical_distance",
            ),
            (
                "near above far",
                Box::new(|f| f["near"] = 3.0.into()),
                "0 < near <= far",
            ),
            (
                "zero near",
                Box::new(|f| f["near"] = 0.0.into()),
                "0 < near <= far",
            ),
            (
                "max_widen below 1",
                Box::new(|f| f["max_widen"] = 0.5.into()),
                "max_widen",
            ),
            (
                "max_widen missing",
                Box::new(|f| {
                    f.as_object_mut().unwrap().remove("max_widen");
                }),
                "missing field `max_widen`",
            ),
            (
                "unknown optimizer",
                Box::new(|f| f["optimizers"] = json!(["lion"])),
                "optimizers: unknown 'lion'",
            ),
            (
                "no precision",
                Box::new(|f| f["precisions"] = json!([])),
                "precisions is empty",
            ),
            (
                "not a number",
                Box::new(|f| f["points"][0][0] = "x".into()),
                "invalid type",
            ),
        ];
        for (name, edit, needle) in cases {
            let mut broken = file();
            edit(&mut broken);
            let error = parse(&broken).expect_err(name);
            assert!(error.contains(needle), "{name}: {error}");
            assert_eq!(error.lines().count(), 1, "{name}: {error}");
        }
        assert!(parse(&file()).is_ok());
    }
}

//! Profiles derived from the stored observations, held in memory.
//!
//! Observations are the data ([`super::db`]: SQLite under `--data-dir`, or PostgreSQL shared
//! by replicas); profiles are derived from them, per GPU and per GPU and environment, by one
//! function ([`derive_profile`]: the observations of a key in, its profile out). Estimates
//! read the derived profiles from memory (a map lookup under a read lock); the database is
//! read only to refresh them: after this process's own writes, and every few seconds
//! (`--profile-refresh-secs`) so that what other replicas record is served here too. A
//! refresh reads a fingerprint of the table first and re-derives only keys whose rows changed.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};

use super::db::{
    self, DbError, Fingerprint, FitRow, NewObservation, ObservationDb, Retention, Source,
};
use super::environment::{self, EnvironmentSample};

use super::profile::{
    check_mib, Calibrated, CalibrationProfile, ProfileError, ProfileWarning, Sample, MAX_SAMPLES,
    MIN_ESTIMATE_MIB,
};
use super::step_time::{self, HostFit, StepTimeSample};
use crate::devices::valid_key;
use crate::physics::Breakdown;

/// A profile's key: the GPU, and the environment for an environment's own profile.
pub type ProfileKey = (String, Option<String>);

/// How many of a key's most recent batches are replayed, each held to
/// [`crate::calibration::fit::MAX_STEP`] from the profile before it; the rows before them
/// are fitted at once as the starting point. Bounds the work of a derivation (at most nine
/// fits) while keeping one batch from swinging a profile by more than a step.
pub const REPLAYED_BATCHES: usize = 8;

/// Observations kept by default: per GPU and environment, and in all.
pub const DEFAULT_RETENTION: Retention = Retention {
    per_key: MAX_SAMPLES,
    total: 100_000,
    bytes: 256 * 1024 * 1024,
};

/// A profile after derivation, and whether its latest batch was held to the step.
#[derive(Debug, Clone, PartialEq)]
pub struct Update {
    pub profile: CalibrationProfile,
    pub limited: bool,
}

/// Rows of one key and what was derived from them: re-derived only when the rows change.
#[derive(Debug, Clone)]
struct Derived {
    /// (count, first id, last id) of the rows it came from.
    rows: (usize, i64, i64),
    update: Update,
}

/// Profiles derived from an observation database.
#[derive(Debug)]
pub struct ProfileStore {
    db: Box<dyn ObservationDb>,
    retention: Retention,
    profiles: RwLock<Arc<HashMap<ProfileKey, Derived>>>,
    /// The table's fingerprint at the last derivation; also serialises refreshes.
    seen: Mutex<Option<Fingerprint>>,
    /// Why the database could not be read or written at the last try; `None` while it works.
    /// Estimates go on with the profiles last derived.
    fault: Mutex<Option<String>>,
    /// Serialises [`ProfileStore::record_checked`]: a check of the profiles that exist and the
    /// write it allows happen as one, so concurrent writers cannot both pass a cap.
    writes: Mutex<()>,
}

impl From<DbError> for ProfileError {
    fn from(e: DbError) -> ProfileError {
        tracing::error!(error = %e, "observation store");
        ProfileError::Store(e.for_callers())
    }
}

impl ProfileStore {
    /// Opens the database (PostgreSQL when `database_url` is given, else SQLite in
    /// `data_dir`), applies migrations, imports the profile files of a former version found in
    /// `data_dir` into an empty database, and derives every profile. Blocks.
    pub fn open(
        data_dir: &Path,
        database_url: Option<&str>,
        retention: Retention,
    ) -> Result<(ProfileStore, Vec<ProfileWarning>), ProfileError> {
        let db = db::open(data_dir, database_url)?;
        let repaired: Vec<ProfileWarning> = db
            .startup_warnings()
            .into_iter()
            .map(|reason| ProfileWarning {
                path: data_dir.join(db::SQLITE_FILE),
                reason,
            })
            .collect();
        let store = ProfileStore {
            db,
            retention,
            profiles: RwLock::new(Arc::new(HashMap::new())),
            seen: Mutex::new(None),
            fault: Mutex::new(None),
            writes: Mutex::new(()),
        };
        let mut warnings = repaired;
        warnings.extend(store.import_profile_files(data_dir)?);
        store.refresh()?;
        Ok((store, warnings))
    }

    /// A SQLite store in `dir` with the default retention (tests, tools).
    pub fn load(dir: &Path) -> Result<(ProfileStore, Vec<ProfileWarning>), ProfileError> {
        ProfileStore::open(dir, None, DEFAULT_RETENTION)
    }

    /// Why the database failed at the last try, while it does; `None` when it works.
    pub fn fault(&self) -> Option<String> {
        self.fault.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Notes whether a database call worked (the store's health, for readiness and answers).
    fn noted<T>(&self, result: Result<T, DbError>) -> Result<T, ProfileError> {
        *self.fault.lock().unwrap_or_else(|p| p.into_inner()) =
            result.as_ref().err().map(DbError::for_callers);
        result.map_err(ProfileError::from)
    }

    /// The database, for logs.
    pub fn describe(&self) -> String {
        self.db.describe()
    }

    pub fn db(&self) -> &dyn ObservationDb {
        self.db.as_ref()
    }

    /// The GPU's own profile (its observations without an environment).
    pub fn get(&self, gpu: &str) -> Option<CalibrationProfile> {
        self.get_key(gpu, None)
    }

    pub fn get_key(&self, gpu: &str, environment: Option<&str>) -> Option<CalibrationProfile> {
        profile(&self.read(), gpu, environment).cloned()
    }

    /// Every profile, by GPU, the GPU's own first and then its environments'.
    pub fn list(&self) -> Vec<CalibrationProfile> {
        let map = self.read();
        let mut all: Vec<_> = map.values().map(|d| d.update.profile.clone()).collect();
        all.sort_by(|a, b| (&a.sku, &a.environment).cmp(&(&b.sku, &b.environment)));
        all
    }

    /// One consistent version of every profile and the store's state, taken once: what a
    /// request reads (a refresh between two reads of the store cannot mix versions).
    pub fn snapshot(&self) -> ProfileSnapshot {
        ProfileSnapshot {
            map: Arc::clone(&self.read()),
            fault: self.fault(),
        }
    }

    /// Records that a job predicted at `predicted_mib` peaked at `observed_mib` on `sku` (no
    /// job description, no environment) and returns the GPU's profile. Tests and tools.
    pub fn observe(
        &self,
        sku: &str,
        predicted_mib: f64,
        observed_mib: f64,
    ) -> Result<CalibrationProfile, ProfileError> {
        let observation = NewObservation {
            gpu: sku.to_string(),
            environment: None,
            job: "null".into(),
            observed_peak_mib: observed_mib,
            predicted_mib,
            breakdown: "null".into(),
            source: Source::Posted,
            step_time: None,
        };
        self.record(vec![observation])?;
        self.get(sku)
            .ok_or_else(|| ProfileError::Store("the observation was trimmed at once".into()))
    }

    /// Stores a batch of observations in one transaction (all or nothing), re-derives the
    /// profiles and returns those the batch touched (each GPU's own, then each environment's).
    /// Blocks: call from `spawn_blocking`.
    /// [`Self::record`] once `check` has passed on the profiles as they are and the batch,
    /// with no other checked write between the two (in this process): `Err` is the check's
    /// refusal, nothing recorded.
    pub fn record_checked<E>(
        &self,
        batch: Vec<NewObservation>,
        check: impl FnOnce(&[CalibrationProfile], &[NewObservation]) -> Result<(), E>,
    ) -> Result<Result<Vec<Update>, ProfileError>, E> {
        let _writing = self.writes.lock().unwrap_or_else(|e| e.into_inner());
        check(&self.list(), &batch)?;
        Ok(self.record(batch))
    }

    pub fn record(&self, batch: Vec<NewObservation>) -> Result<Vec<Update>, ProfileError> {
        for o in &batch {
            if !valid_key(&o.gpu) {
                return Err(ProfileError::InvalidSku(o.gpu.clone()));
            }
            if let Some(e) = &o.environment {
                super::label::parse_environment(e).map_err(ProfileError::InvalidObservation)?;
            }
            check_mib("predicted_mib", o.predicted_mib)?;
            check_mib("observed_mib", o.observed_peak_mib)?;
        }
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        self.noted(self.db.insert(&batch, self.retention))?;
        let mut keys: Vec<ProfileKey> = Vec::new();
        for o in &batch {
            let key = (o.gpu.clone(), o.environment.clone());
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        // Committed: whatever happens next, the call is answered as recorded (a retry would
        // record it twice). Only the keys the batch touched are derived again, from their own
        // rows: a write costs its keys' rows (at most the retention per key), not the store.
        // The periodic refresh catches up with the rest (other replicas' rows, rows the
        // retention trimmed from other keys), and retries a derivation that fails here.
        if let Err(error) = self.derive_keys(&keys) {
            tracing::warn!(%error, "recorded, but the profiles could not be derived again yet");
        }
        let map = self.read();
        Ok(keys
            .iter()
            .filter_map(|k| map.get(k).map(|d| d.update.clone()))
            .collect())
    }

    /// Re-derives `keys`' profiles from their rows alone. The store's fingerprint is left as
    /// last seen, so the next [`Self::refresh`] still reads everything once (it reuses these
    /// derivations where the rows are the same).
    fn derive_keys(&self, keys: &[ProfileKey]) -> Result<(), ProfileError> {
        let _seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut derived = Vec::with_capacity(keys.len());
        for key in keys {
            let rows = self.noted(self.db.fit_rows_of(&key.0, key.1.as_deref()))?;
            let rows: Vec<&FitRow> = rows.iter().collect();
            derived.push((key.clone(), derive_key(key, &rows)));
        }
        let mut map = HashMap::clone(&self.read());
        for (key, update) in derived {
            map.insert(key, update);
        }
        *self.profiles.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(map);
        Ok(())
    }

    /// Re-derives the profiles if the stored observations changed since the last time; true
    /// when they did. Blocks: call from `spawn_blocking`.
    pub fn refresh(&self) -> Result<bool, ProfileError> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let fingerprint = self.noted(self.db.fingerprint())?;
        if *seen == Some(fingerprint) {
            return Ok(false);
        }
        let mut rows = self.noted(self.db.fit_rows())?;
        // Keys are checked when read as when written: a row put in by hand (or by an older
        // build) with a key this one would refuse serves no profile.
        let stored = rows.len();
        rows.retain(|r| {
            valid_key(&r.gpu)
                && r.environment
                    .as_deref()
                    .is_none_or(|e| super::label::parse_environment(e).is_ok())
        });
        if rows.len() < stored {
            tracing::warn!(
                skipped = stored - rows.len(),
                "stored observations with an invalid GPU or environment key were skipped"
            );
        }
        let previous = Arc::clone(&self.read());
        let derived = derive_all(&rows, &previous);
        *self.profiles.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(derived);
        *seen = Some(fingerprint);
        Ok(true)
    }

    /// Imports `<gpu>.json` profile files (the store before observations were kept) into an
    /// empty database: their samples become observations without a job description. The files
    /// are left in place; they are read no more once the database holds observations.
    fn import_profile_files(&self, dir: &Path) -> Result<Vec<ProfileWarning>, ProfileError> {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Ok(Vec::new());
        };
        let mut paths: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json") && p.is_file())
            .collect();
        if paths.is_empty() || self.db.fingerprint()?.0 > 0 {
            return Ok(Vec::new());
        }
        paths.sort();
        let mut warnings = Vec::new();
        for path in paths {
            let parsed = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| {
                    serde_json::from_slice::<CalibrationProfile>(&b).map_err(|e| e.to_string())
                })
                .and_then(|p| p.validate().map(|()| p).map_err(|e| e.to_string()));
            match parsed {
                Ok(profile) => {
                    let batch: Vec<NewObservation> = profile
                        .samples
                        .iter()
                        .map(|s: &Sample| NewObservation {
                            gpu: profile.sku.clone(),
                            environment: None,
                            job: "null".into(),
                            observed_peak_mib: s.observed_mib,
                            predicted_mib: s.predicted_mib,
                            breakdown: "null".into(),
                            source: Source::Posted,
                            step_time: None,
                        })
                        .collect();
                    if !batch.is_empty() {
                        self.db.insert(&batch, self.retention)?;
                    }
                    tracing::info!(file = %path.display(), observations = batch.len(), "profile file imported as observations");
                }
                Err(reason) => warnings.push(ProfileWarning {
                    path,
                    reason: format!("not imported: {reason}"),
                }),
            }
        }
        Ok(warnings)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Arc<HashMap<ProfileKey, Derived>>> {
        // Writers swap the whole map, so a poisoned lock still holds a consistent one.
        self.profiles
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The profiles as one request reads them ([`ProfileStore::snapshot`]).
#[derive(Debug, Clone)]
pub struct ProfileSnapshot {
    map: Arc<HashMap<ProfileKey, Derived>>,
    fault: Option<String>,
}

/// Which version of the profiles a snapshot is, without keeping its profiles alive: an answer
/// kept for reuse is valid only while the profiles it read are current
/// ([`crate::engine::memo`]).
#[derive(Debug, Clone)]
pub struct ProfileVersion {
    map: std::sync::Weak<HashMap<ProfileKey, Derived>>,
    stale: bool,
}

impl ProfileVersion {
    /// Whether `snapshot` is this version: the same derived map (a weak reference keeps its
    /// address from being reused), read in the same state of the store.
    pub fn is(&self, snapshot: &ProfileSnapshot) -> bool {
        std::ptr::eq(self.map.as_ptr(), Arc::as_ptr(&snapshot.map))
            && self.stale == snapshot.stale()
    }
}

impl ProfileSnapshot {
    /// This snapshot's version ([`ProfileVersion`]).
    pub fn version(&self) -> ProfileVersion {
        ProfileVersion {
            map: Arc::downgrade(&self.map),
            stale: self.stale(),
        }
    }

    /// True while the store cannot be read: these are the profiles last derived.
    pub fn stale(&self) -> bool {
        self.fault.is_some()
    }

    /// `predicted_mib` (and the model's `upper_mib`) moved onto `gpu` by the profile of
    /// `gpu` in `environment` when there is one, else by the GPU's own; `None` when neither
    /// exists (or the prediction is not a positive finite number). The answer names the
    /// environment whose profile was used (`None`: the GPU's). A map lookup: no I/O.
    pub fn calibrate(
        &self,
        gpu: &str,
        environment: Option<&str>,
        predicted_mib: f64,
        upper_mib: Option<f64>,
    ) -> Option<Calibrated> {
        if !(predicted_mib.is_finite() && predicted_mib > 0.0) {
            return None;
        }
        let map = &self.map;
        nearest(map, gpu, environment).map(|p| p.calibrate(predicted_mib, upper_mib))
    }

    /// The host cost per op fitted to the step times observed on `gpu` in `environment` (the
    /// GPU's own profile where none is named); `None` when that profile has none. An
    /// environment without a fit of its own keeps the calibrated cost, not the GPU's: a card's
    /// step times, and so its ranking, move only on evidence from the environment asked
    /// about. A map lookup.
    pub fn host_fit(&self, gpu: &str, environment: Option<&str>) -> Option<HostFit> {
        profile(&self.map, gpu, environment).and_then(|p| p.host_fit)
    }

    /// [`Self::calibrate`] for a job whose predicted `breakdown` (physics' categories of
    /// `predicted_mib`) is known. When the profile used is an environment's with an
    /// [`environment::EnvironmentFit`], the estimate and bound are the fit applied to the
    /// breakdown at `confidence` ([`environment::apply`]): the environment's own bound from its
    /// first observation, held within [`environment::reach`] of physics (the most any number
    /// of observations may move it). An environment observed on other cards but not on `gpu`
    /// lends its stack (the factor and the categories' scales, not the context, which is the
    /// card's and driver's): the one observed most. Otherwise the line, as
    /// [`Self::calibrate`].
    pub fn calibrate_breakdown(
        &self,
        gpu: &str,
        environment: Option<&str>,
        predicted_mib: f64,
        upper_mib: Option<f64>,
        breakdown: &Breakdown,
        confidence: f64,
    ) -> Option<Calibrated> {
        if !(predicted_mib.is_finite() && predicted_mib > 0.0) {
            return None;
        }
        let map = &self.map;
        let own = environment.and_then(|e| profile(map, gpu, Some(e)));
        let lent = match (own, environment) {
            (None, Some(e)) => stack_elsewhere(map, e),
            _ => None,
        };
        let line = match nearest(map, gpu, environment) {
            Some(p) => p.calibrate(predicted_mib, upper_mib),
            None => {
                let lent = lent.as_ref()?;
                Calibrated {
                    sku: gpu.to_string(),
                    environment: environment.map(str::to_string),
                    estimate_mib: predicted_mib,
                    upper_bound_mib: upper_mib.unwrap_or(predicted_mib),
                    observations: lent.samples as u64,
                    offset_mib: 0.0,
                    scale: 1.0,
                    cuda_context_mib: None,
                    stack_factor: None,
                }
            }
        };
        let Some(fit) = own
            .and_then(|p| p.environment_fit.as_ref())
            .filter(|f| f.samples > 0)
            .or(lent.as_ref())
        else {
            return Some(line);
        };
        let (estimate, bound) = environment::apply(fit, breakdown, confidence);
        if !(estimate.is_finite() && bound.is_finite()) {
            return Some(line);
        }
        let (low, high) = environment::reach(predicted_mib);
        let estimate_mib = estimate.clamp(low, high).max(MIN_ESTIMATE_MIB);
        // The bound within the reach of the uncalibrated bound: however the observations
        // scatter, they may not widen it past that (a bound as wide as the card refuses
        // every fit).
        let uncalibrated_bound = upper_mib.filter(|u| u.is_finite()).unwrap_or(predicted_mib);
        let bound_high = environment::reach(uncalibrated_bound.max(predicted_mib)).1;
        let upper_bound_mib = bound.min(bound_high).max(estimate_mib);
        Some(Calibrated {
            estimate_mib,
            upper_bound_mib,
            environment: environment.map(str::to_string),
            observations: if own.is_some() {
                line.observations
            } else {
                fit.samples as u64
            },
            cuda_context_mib: fit.context_mib,
            stack_factor: Some(fit.stack_factor),
            ..line
        })
    }
}

/// The profile of `gpu` in `environment` (`None`: the GPU's own), if there is one.
fn profile<'a>(
    map: &'a HashMap<ProfileKey, Derived>,
    gpu: &str,
    environment: Option<&str>,
) -> Option<&'a CalibrationProfile> {
    map.get(&(gpu.to_string(), environment.map(str::to_string)))
        .map(|d| &d.update.profile)
}

/// The fit of `environment` on the card where it was observed most, without the context
/// (the card's and driver's, not the stack's): what the environment lends a card it was not
/// observed on.
fn stack_elsewhere(
    map: &HashMap<ProfileKey, Derived>,
    environment: &str,
) -> Option<environment::EnvironmentFit> {
    // The most observations; on a tie the first card by name (the map's order is not).
    map.iter()
        .filter(|((_, e), _)| e.as_deref() == Some(environment))
        .filter_map(|((gpu, _), d)| Some((gpu, d.update.profile.environment_fit.as_ref()?)))
        .filter(|(_, f)| f.samples > 0)
        .max_by(|(a, f), (b, g)| f.samples.cmp(&g.samples).then(b.cmp(a)))
        .map(|(_, f)| environment::EnvironmentFit {
            context_mib: None,
            allocator_fixed_mib: 0.0,
            ..f.clone()
        })
}

/// The profile an estimate of `gpu` in `environment` uses: the environment's, else the GPU's.
fn nearest<'a>(
    map: &'a HashMap<ProfileKey, Derived>,
    gpu: &str,
    environment: Option<&str>,
) -> Option<&'a CalibrationProfile> {
    environment
        .and_then(|e| profile(map, gpu, Some(e)))
        .or_else(|| profile(map, gpu, None))
}

/// Every key's profile from `rows` (oldest first), reusing `previous` for keys whose rows are
/// unchanged.
fn derive_all(
    rows: &[FitRow],
    previous: &HashMap<ProfileKey, Derived>,
) -> HashMap<ProfileKey, Derived> {
    let mut by_key: BTreeMap<ProfileKey, Vec<&FitRow>> = BTreeMap::new();
    // Each observation informs its own key only: an environment's observations never move
    // the GPU's own profile, which every other environment without a profile falls back to.
    for row in rows {
        by_key
            .entry((row.gpu.clone(), row.environment.clone()))
            .or_default()
            .push(row);
    }
    by_key
        .into_iter()
        .map(|(key, rows)| {
            let derived = match previous.get(&key) {
                Some(d) if d.rows == signature(&rows) => d.clone(),
                _ => derive_key(&key, &rows),
            };
            (key, derived)
        })
        .collect()
}

/// What says a key's rows are the same as when it was derived: (count, first id, last id).
fn signature(rows: &[&FitRow]) -> (usize, i64, i64) {
    (
        rows.len(),
        rows.first().map_or(0, |r| r.id),
        rows.last().map_or(0, |r| r.id),
    )
}

/// One key's profile from its rows (oldest first), with their signature.
fn derive_key(key: &ProfileKey, rows: &[&FitRow]) -> Derived {
    Derived {
        rows: signature(rows),
        update: derive_profile(&key.0, key.1.as_deref(), rows),
    }
}

/// The seam: one key's observations (oldest first) in, its profile out.
///
/// Today an offset and scale ([`super::fit::fit_profile`]) over the newest [`MAX_SAMPLES`]
/// observations, the last [`REPLAYED_BATCHES`] batches each held to the step from the profile
/// before it. An environment's profile is the same fit restricted to its observations.
pub fn derive_profile(gpu: &str, environment: Option<&str>, rows: &[&FitRow]) -> Update {
    let rows = &rows[rows.len().saturating_sub(MAX_SAMPLES)..];
    let updated_at = rows.iter().map(|r| r.recorded_at).max().unwrap_or(0).max(0) as u64;
    // Batches in the order they were recorded (by their last row).
    let mut last_id: HashMap<i64, i64> = HashMap::new();
    for r in rows {
        last_id.insert(r.batch_id, r.id);
    }
    let mut batches: Vec<(i64, i64)> = last_id.into_iter().map(|(b, id)| (id, b)).collect();
    batches.sort_unstable();
    let rank: HashMap<i64, usize> = batches
        .iter()
        .enumerate()
        .map(|(i, (_, b))| (*b, i))
        .collect();
    let fit_through = |last: usize| {
        let samples: Vec<Sample> = rows
            .iter()
            .filter(|r| rank[&r.batch_id] <= last)
            .map(|r| Sample {
                predicted_mib: r.predicted_mib,
                observed_mib: r.observed_peak_mib,
            })
            .collect();
        let mut profile =
            CalibrationProfile::fitted(gpu, samples.len() as u64, samples, updated_at);
        profile.environment = environment.map(str::to_string);
        profile
    };
    let first = batches.len().saturating_sub(REPLAYED_BATCHES);
    let mut profile = (first > 0).then(|| fit_through(first - 1));
    let mut limited = false;
    for last in first..batches.len() {
        let (held, was_limited) = fit_through(last).held_to_step(profile.as_ref());
        profile = Some(held);
        limited = was_limited;
    }
    let mut profile = profile.unwrap_or_else(|| fit_through(0));
    if environment.is_some() {
        profile.environment_fit = environment_fit(rows);
    }
    profile.host_fit = host_fit(rows, &rank, first, batches.len());
    Update { profile, limited }
}

/// The host's cost per op fitted to those of the rows (the newest [`MAX_SAMPLES`]) that carry
/// a measured step time ([`step_time::fit_host_cost`]), under the rules memory's fit keeps:
/// within reach of the calibrated cost ([`HostFit::within_reach`]), and the batches from
/// `first` on (of `batches`, ranked by `rank`) replayed, each held to one step from the fit
/// before it ([`HostFit::held_to_step`]); `None` when no row has a step time.
fn host_fit(
    rows: &[&FitRow],
    rank: &HashMap<i64, usize>,
    first: usize,
    batches: usize,
) -> Option<HostFit> {
    let samples: Vec<(usize, StepTimeSample)> = rows
        .iter()
        .filter_map(|r| {
            let (observed_ms, curve) = r.step_time.as_ref()?;
            let sample = StepTimeSample {
                curve: serde_json::from_str(curve).ok()?,
                observed_ms: *observed_ms,
            };
            Some((rank[&r.batch_id], sample))
        })
        .collect();
    if samples.is_empty() {
        return None;
    }
    let through = |last: usize| {
        let upto: Vec<StepTimeSample> = samples
            .iter()
            .filter(|(batch, _)| *batch <= last)
            .map(|(_, sample)| sample.clone())
            .collect();
        step_time::fit_host_cost(&upto)
    };
    let mut held = first
        .checked_sub(1)
        .and_then(through)
        .map(HostFit::within_reach);
    for last in first..batches {
        held = through(last).map(|fit| fit.held_to_step(held.as_ref()));
    }
    held
}

/// What an environment changes ([`environment::fit_environment`]), fitted to those of its
/// rows (the newest [`MAX_SAMPLES`]) that carry the predicted breakdown: the observed peaks
/// are device-level (what the probe and nvidia-smi report). Rows without one (imported from
/// the profile files of a former version) are left out; `None` when no row has one.
///
/// The fit is not replayed batch by batch like the line: its parameters are held to their own
/// ranges and shrunk toward physics by construction, and its answers are held within a step
/// of the environment's line ([`ProfileStore::calibrate_breakdown`]), which is.
fn environment_fit(rows: &[&FitRow]) -> Option<environment::EnvironmentFit> {
    let samples: Vec<EnvironmentSample> = rows
        .iter()
        .filter_map(|r| {
            let predicted = stored_breakdown(&r.breakdown)?;
            Some(EnvironmentSample::device(predicted, r.observed_peak_mib))
        })
        .collect();
    let fit = environment::fit_environment(&samples);
    (fit.samples > 0).then_some(fit)
}

/// A row's predicted breakdown (a JSON object of the categories, MiB); `None` for `null` or
/// a missing category (JSON holds no non-finite number).
fn stored_breakdown(json: &str) -> Option<Breakdown> {
    serde_json::from_str(json).ok()
}

#[cfg(test)]
mod tests;

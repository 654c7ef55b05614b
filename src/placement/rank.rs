//! The order in which to offer the cards of a `gpu` list.

/// One card of a `gpu` list, as [`rank`] weighs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub fits: bool,
    /// The predicted step time; `None` where the card has no peak figures.
    pub step_time_ms: Option<f64>,
    pub capacity_mib: u64,
    /// The figure a scheduler reserves (the upper bound), to order the cards the job misses.
    pub upper_bound_mib: f64,
}

/// The order in which to offer the cards of a `gpu` list, as indices into `candidates`: the
/// cards the job fits first, fastest predicted step first (a card without a prediction after
/// those with one), then the smaller card (it leaves the larger free for jobs that need it);
/// then the cards it misses, nearest to fitting first. Stable: equal cards keep the caller's
/// order.
pub fn rank(candidates: &[Candidate]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&candidates[a], &candidates[b]);
        let shortfall = |c: &Candidate| c.upper_bound_mib / c.capacity_mib.max(1) as f64;
        b.fits.cmp(&a.fits).then_with(|| {
            if a.fits {
                let time = |c: &Candidate| c.step_time_ms.unwrap_or(f64::INFINITY);
                time(a)
                    .total_cmp(&time(b))
                    .then(a.capacity_mib.cmp(&b.capacity_mib))
            } else {
                shortfall(a).total_cmp(&shortfall(b))
            }
        })
    });
    order
}

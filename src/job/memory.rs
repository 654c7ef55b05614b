//! Memory classes: contiguous MiB ranges cut at fixed upper bounds, GPUMemNet style.

/// Class bins `[b0, ..., bk]`: class 0 is `(0, b0]`, class i is `(b(i-1), bi]`, and the last
/// class, `(bk, inf)`, is open.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryClasses {
    upper_bounds_mib: Vec<u64>,
}

/// One class as a MiB range; `upper_mib` is `None` for the open top class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryClass {
    pub index: usize,
    pub lower_mib: u64,
    pub upper_mib: Option<u64>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("class bins must be non-empty and strictly increasing, got {0:?}")]
pub struct InvalidBins(pub Vec<u64>);

impl MemoryClasses {
    pub fn new(upper_bounds_mib: Vec<u64>) -> Result<MemoryClasses, InvalidBins> {
        let increasing = upper_bounds_mib.windows(2).all(|w| w[0] < w[1]);
        if upper_bounds_mib.is_empty() || !increasing || upper_bounds_mib[0] == 0 {
            return Err(InvalidBins(upper_bounds_mib));
        }
        Ok(MemoryClasses { upper_bounds_mib })
    }

    /// Number of classes, the open top class included.
    pub fn len(&self) -> usize {
        self.upper_bounds_mib.len() + 1
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// The class holding a peak of `mib`.
    pub fn classify(&self, mib: f64) -> MemoryClass {
        let index = self
            .upper_bounds_mib
            .iter()
            .take_while(|&&upper| mib > upper as f64)
            .count();
        self.class(index)
    }

    /// The class at `index`, clamped to the top class.
    pub fn class(&self, index: usize) -> MemoryClass {
        let index = index.min(self.upper_bounds_mib.len());
        MemoryClass {
            index,
            lower_mib: if index == 0 {
                0
            } else {
                self.upper_bounds_mib[index - 1]
            },
            upper_mib: self.upper_bounds_mib.get(index).copied(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpumemnet_mlp_bins() -> MemoryClasses {
        MemoryClasses::new(vec![1000, 2000, 3000, 4000, 5000]).unwrap()
    }

    #[test]
    fn class_upper_bounds_are_inclusive() {
        let classes = gpumemnet_mlp_bins();
        assert_eq!(classes.len(), 6);
        assert_eq!(classes.classify(1.0).index, 0);
        assert_eq!(classes.classify(1000.0).index, 0);
        assert_eq!(classes.classify(1000.5).index, 1);
        assert_eq!(
            classes.classify(1545.0),
            MemoryClass {
                index: 1,
                lower_mib: 1000,
                upper_mib: Some(2000)
            }
        );
        assert_eq!(classes.classify(5000.0).index, 4);
    }

    #[test]
    fn the_top_class_is_open() {
        let classes = gpumemnet_mlp_bins();
        assert_eq!(
            classes.classify(1e9),
            MemoryClass {
                index: 5,
                lower_mib: 5000,
                upper_mib: None
            }
        );
        assert_eq!(classes.class(99).index, 5);
    }

    #[test]
    fn bins_must_increase() {
        assert!(MemoryClasses::new(vec![]).is_err());
        assert!(MemoryClasses::new(vec![2000, 1000]).is_err());
        assert!(MemoryClasses::new(vec![0, 1000]).is_err());
    }
}

/// Conformal quantiles of log(measured / predicted) at several confidence levels; the upper
/// bound at confidence c is `estimate x exp(q(c))`, q interpolated linearly between levels.
#[derive(Debug, Clone, PartialEq)]
pub struct ResidualQuantiles {
    /// (confidence, log ratio), sorted by confidence.
    levels: Vec<(f64, f64)>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error(
    "residual quantiles must be finite, non-decreasing and at confidences strictly between 0 and 1"
)]
pub struct InvalidQuantiles;

impl ResidualQuantiles {
    pub fn new(mut levels: Vec<(f64, f64)>) -> Result<ResidualQuantiles, InvalidQuantiles> {
        levels.sort_by(|a, b| a.0.total_cmp(&b.0));
        let valid_level = |&(c, q): &(f64, f64)| c > 0.0 && c < 1.0 && q.is_finite();
        let increasing = levels
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1);
        if levels.is_empty() || !levels.iter().all(valid_level) || !increasing {
            return Err(InvalidQuantiles);
        }
        Ok(ResidualQuantiles { levels })
    }

    /// The confidence range covered: requests outside it cannot be honoured.
    pub fn range(&self) -> (f64, f64) {
        (self.levels[0].0, self.levels[self.levels.len() - 1].0)
    }

    /// The log ratio at `confidence`, or `None` outside the covered range.
    pub fn log_ratio_at(&self, confidence: f64) -> Option<f64> {
        let (low, high) = self.range();
        if !(low..=high).contains(&confidence) {
            return None;
        }
        let upper = self.levels.iter().position(|&(c, _)| c >= confidence)?;
        if upper == 0 {
            return Some(self.levels[0].1);
        }
        let ((c0, q0), (c1, q1)) = (self.levels[upper - 1], self.levels[upper]);
        Some(q0 + (q1 - q0) * (confidence - c0) / (c1 - c0))
    }
}

#[cfg(test)]
mod quantile_tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_between_levels_and_refuse_outside_them() {
        let q = ResidualQuantiles::new(vec![(0.95, 0.2), (0.5, 0.0), (0.99, 0.4)]).unwrap();
        assert_eq!(q.range(), (0.5, 0.99));
        assert_eq!(q.log_ratio_at(0.5), Some(0.0));
        assert!((q.log_ratio_at(0.725).unwrap() - 0.1).abs() < 1e-12);
        assert_eq!(q.log_ratio_at(0.99), Some(0.4));
        assert_eq!(q.log_ratio_at(0.999), None);
        assert_eq!(q.log_ratio_at(0.3), None);
    }

    #[test]
    fn quantiles_must_grow_with_confidence() {
        assert!(ResidualQuantiles::new(vec![]).is_err());
        assert!(ResidualQuantiles::new(vec![(0.5, 0.3), (0.9, 0.1)]).is_err());
        assert!(ResidualQuantiles::new(vec![(1.0, 0.3)]).is_err());
        assert!(ResidualQuantiles::new(vec![(0.9, f64::NAN)]).is_err());
    }
}

/// The confidence an upper bound must hold at: the share of jobs whose true peak stays below.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Confidence(f64);

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("confidence: must be a number from 0.5 to 0.99, got {0}")]
pub struct InvalidConfidence(pub f64);

impl Confidence {
    pub const DEFAULT: Confidence = Confidence(0.95);

    pub fn parse(raw: Option<f64>) -> Result<Confidence, InvalidConfidence> {
        match raw {
            None => Ok(Confidence::DEFAULT),
            Some(c) if (0.5..=0.99).contains(&c) => Ok(Confidence(c)),
            Some(c) => Err(InvalidConfidence(c)),
        }
    }

    pub fn get(self) -> f64 {
        self.0
    }
}

#[cfg(test)]
mod confidence_tests {
    use super::*;

    #[test]
    fn confidence_defaults_to_95_percent_and_must_lie_in_range() {
        assert_eq!(Confidence::parse(None).unwrap().get(), 0.95);
        assert_eq!(Confidence::parse(Some(0.9)).unwrap().get(), 0.9);
        assert!(Confidence::parse(Some(1.0)).is_err());
        assert!(Confidence::parse(Some(0.2)).is_err());
    }
}

/// The share of the card's memory a job caps its caching allocator at
/// (`torch.cuda.set_per_process_memory_fraction`): 0 < f <= 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryFraction(f64);

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("memory_fraction: must be a number greater than 0 and at most 1, got {0}")]
pub struct InvalidMemoryFraction(pub f64);

impl MemoryFraction {
    pub fn parse(raw: Option<f64>) -> Result<Option<MemoryFraction>, InvalidMemoryFraction> {
        match raw {
            None => Ok(None),
            Some(f) if f > 0.0 && f <= 1.0 => Ok(Some(MemoryFraction(f))),
            Some(f) => Err(InvalidMemoryFraction(f)),
        }
    }

    pub fn get(self) -> f64 {
        self.0
    }
}

#[cfg(test)]
mod memory_fraction_tests {
    use super::*;

    #[test]
    fn a_memory_fraction_is_optional_and_lies_in_zero_exclusive_to_one() {
        assert_eq!(MemoryFraction::parse(None), Ok(None));
        assert_eq!(
            MemoryFraction::parse(Some(1.0)).unwrap().unwrap().get(),
            1.0
        );
        assert_eq!(
            MemoryFraction::parse(Some(0.25)).unwrap().unwrap().get(),
            0.25
        );
        for bad in [0.0, -0.5, 1.01, f64::NAN] {
            assert!(MemoryFraction::parse(Some(bad)).is_err(), "{bad}");
        }
    }
}

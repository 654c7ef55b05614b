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
        let index = self.upper_bounds_mib.iter().take_while(|&&upper| mib > upper as f64).count();
        self.class(index)
    }

    /// The class at `index`, clamped to the top class.
    pub fn class(&self, index: usize) -> MemoryClass {
        let index = index.min(self.upper_bounds_mib.len());
        MemoryClass {
            index,
            lower_mib: if index == 0 { 0 } else { self.upper_bounds_mib[index - 1] },
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
        assert_eq!(classes.classify(1545.0), MemoryClass { index: 1, lower_mib: 1000, upper_mib: Some(2000) });
        assert_eq!(classes.classify(5000.0).index, 4);
    }

    #[test]
    fn the_top_class_is_open() {
        let classes = gpumemnet_mlp_bins();
        assert_eq!(classes.classify(1e9), MemoryClass { index: 5, lower_mib: 5000, upper_mib: None });
        assert_eq!(classes.class(99).index, 5);
    }

    #[test]
    fn bins_must_increase() {
        assert!(MemoryClasses::new(vec![]).is_err());
        assert!(MemoryClasses::new(vec![2000, 1000]).is_err());
        assert!(MemoryClasses::new(vec![0, 1000]).is_err());
    }
}

"""The constants the stages share: seeds, versions, class bins, capacities, folds, confidences.

Standard library only (the stdlib stages and the tests import it).
"""

from . import cards

# Every split, fold shuffle and model initialisation derives from this seed (fold k: SEED + k,
# the MLP stage's CV folds: SEED + 1000 x (k + 1)).
SEED = 20260101
# The `version` of every estimator the manifest lists.
VERSION = "1.0.0"
MIB = 1024.0 * 1024.0

# GPUMemNet's MLP data (gpumemnet_mlp_a100.csv): 1 GiB-wide classes (0,1000], ..., (5000,inf) MiB.
MLP_CLASS_BINS_MIB = [1000, 2000, 3000, 4000, 5000]
MLP_FOLDS = 3
MLP_TEST_FRACTION = 0.2
MLP_MAX_TOKENS = 512

# The timm data (timm_a100_train.csv): measured on an A100 40 GB; 8 GB-wide classes up to the
# card, the top class (40960, inf) meaning "does not fit". The card's memory is read from the
# service's catalogue (data/gpus.json), the one place it is written.
REFERENCE_GPU = "a100-40gb"
CAPACITY_MIB = cards.memory_mib(REFERENCE_GPU)
REAL_CLASS_BINS_MIB = [8000, 16000, 24000, 32000, CAPACITY_MIB]
REAL_FOLDS = 5
REAL_TEST_GROUP_FRACTION = 0.15
REAL_MAX_TOKENS = 4096
FAMILIES = ["cnn", "transformer"]

# Conformal quantiles of log(measured / predicted) are kept at these confidences; the served
# upper bound is the one at BOUND_CONFIDENCE.
CONFIDENCES = [0.5, 0.8, 0.9, 0.95, 0.975, 0.99]
BOUND_CONFIDENCE = 0.95

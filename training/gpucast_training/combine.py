"""How the simulated stage combines a simulated job's figures into one answer: the rule of the
service's src/estimators/combine.rs (`correction_applies`, `within_measured_range`,
`bound_widening`, the simulated bound capped at the card in `Partial::finish`, the floor of
`Physics::settle`), before the service reads its bound from the distribution of the peak's terms.

Standard library only. training/tests/golden/combine.json holds cases of this rule (inputs ->
outputs) that training/tests/test_combine.py checks `combine` against; the service's rule is
checked against the same file.

Why a Python statement of the rule remains when the features come from the service (issue 36):
the stage scores models while it trains them. Its inputs are the out-of-fold predictions of fold
models, a CUDA context, residual quantiles and a typical distance fitted per fold or per stage,
and per-row card capacities of the public rows; `gpucast estimate --batch` answers only with the
committed models and the manifest's context, quantiles and domain, so it cannot produce these
figures for models that are not (yet) served. Scoring through the binary would need a throw-away
models directory per fold (ONNX members, a manifest, a domain file). The golden cases keep the
two statements equal instead. simulated.py's `simulated_figure`, `floor_figure` and
`runs_on_card` stay for the same reason: they take the fold's fitted context.
"""

import math

from .constants import CAPACITY_MIB

# Beyond NEAR x the typical distance of a new family, the bound widens (by ratio / NEAR, at most
# MAX_WIDEN); beyond FAR x it, or for another optimizer or precision than the data's, the
# correction is not applied at all (the simulated figure leads).
NEAR, FAR, MAX_WIDEN = 1.0, 2.0, 2.0


def combine(
    log_learned,
    sim_fig,
    floor,
    distance,
    typical,
    log_q95_learned,
    log_q95_sim,
    runs_on_card,
    capacity=CAPACITY_MIB,
    measured_range=True,
):
    """The service's rule (src/estimators/combine.rs and mod.rs): the correction where the job
    is near the training data, the simulated figure far from it (or for another setup); the
    bound widens with the distance; a simulated bound is capped at the card where the step runs
    there; the correction applies only to steps that run on the card its labels were measured on
    (`measured_range`); then the floor holds the figure and the bound is never below the figure."""
    ratio = distance / typical
    widen = min(max(ratio / NEAR, 1.0), MAX_WIDEN)
    far = ratio > FAR or not measured_range
    if far:
        figure = sim_fig
        bound = figure * math.exp(log_q95_sim * widen)
        if runs_on_card:
            bound = max(min(bound, capacity), figure)
    else:
        figure = math.exp(log_learned)
        bound = figure * math.exp(log_q95_learned * widen)
    figure = max(figure, floor)
    return figure, max(bound, figure), far

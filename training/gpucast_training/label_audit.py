"""Which rows of the timm data are measurements of a job's need, from each model's own readings.

The CSV's `status` was inferred from the readings (data README). Two kinds of rows contradict
the physics of a training step, whose peak is a fixed part plus batch x a per-sample part:

- an `ok` row that reads no more than the model's last trusted reading at a smaller batch size,
  or more than that reading x batch ratio (+10 % for allocator rounding): a run that failed early,
  or a reading shared with something else (resnetaa50d: 4,489 MiB at 16, 38,835 MiB at 32); and
  an `ok` row whose reading a neighbouring batch size repeats (volo_d5_512: 9,507 MiB at 32 and
  64), a stuck reading;
- an `oom` row whose model's trusted readings extrapolate to under 90 % of the card: a crash, not
  a job that needed more than 40 GB (vit_betwixt_patch32_clip_224: 1,969 and 2,391 MiB at 8 and
  16, then 'oom' at 32 reading 1,969 MiB).

Rows are (model, batch_size, status, peak_mib) tuples; every function returns one flag per row.
Standard library only (the timm stage learns with it, the evaluate stage reports it).
"""

from .constants import CAPACITY_MIB

CREDIBLE_SHARE = 0.9
ROUNDING_SLACK = 1.1


def _by_model(rows):
    models = {}
    for index, (model, batch, _, _) in enumerate(rows):
        models.setdefault(model, []).append(index)
    return [sorted(indices, key=lambda i: rows[i][1]) for indices in models.values()]


def credible_oom(rows):
    """oom rows from a model's first oom reading >= 90 % of the capacity on (larger batches of a
    model that ran out of memory also do)."""
    flags = [False] * len(rows)
    for indices in _by_model(rows):
        seen = False
        for index in indices:
            _, _, status, peak = rows[index]
            if status == "oom" and peak >= CREDIBLE_SHARE * CAPACITY_MIB:
                seen = True
            flags[index] = seen and status == "oom"
    return flags


def _trusted_walk(rows, indices):
    """Yields (index, trusted readings so far, failed ok flag) in batch order."""
    trusted = []
    for position, index in enumerate(indices):
        _, batch, status, peak = rows[index]
        # A reading that a neighbouring batch size repeats is stuck, not a measurement.
        neighbours = indices[max(0, position - 1) : position] + indices[position + 1 : position + 2]
        failed = status == "ok" and any(abs(rows[i][3] - peak) <= 0.01 * peak for i in neighbours)
        if status == "ok" and trusted and not failed:
            batch0, peak0 = trusted[-1]
            failed = peak <= 1.01 * peak0 or peak > ROUNDING_SLACK * peak0 * batch / batch0
        yield index, list(trusted), failed
        if status == "ok" and not failed:
            trusted.append((batch, peak))


def failed_ok(rows):
    """ok rows whose reading no working run gives (see the module doc)."""
    flags = [False] * len(rows)
    for indices in _by_model(rows):
        for index, _, failed in _trusted_walk(rows, indices):
            flags[index] = failed
    return flags


def fitting_oom(rows):
    """oom rows whose model's trusted readings say the job fits: the line through the last two
    (or, with one, the bound peak x batch ratio, as the fixed part is >= 0) stays under 90 % of
    the card at the row's batch size."""
    flags = [False] * len(rows)
    for indices in _by_model(rows):
        for index, trusted, _ in _trusted_walk(rows, indices):
            _, batch, status, _ = rows[index]
            if status != "oom" or not trusted:
                continue
            if len(trusted) >= 2:
                (batch1, peak1), (batch2, peak2) = trusted[-2:]
                need = peak2 + max(0.0, (peak2 - peak1) / (batch2 - batch1)) * (batch - batch2)
            else:
                batch2, peak2 = trusted[0]
                need = peak2 * batch / batch2
            flags[index] = need < CREDIBLE_SHARE * CAPACITY_MIB
    return flags

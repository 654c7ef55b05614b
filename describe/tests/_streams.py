"""A switch of the simulation that must not change what it records: the allocation stream the
allocator model replays, and the result, with the switch off and on."""

import torch

from gpucast_describe import allocator, simulate, simulate_step


def assert_same_stream(test, switch, model, shape, batch, dtype=torch.float32, **setup):
    """Simulates `model` with `simulate.<switch>` False then True (restored to True after) and
    asserts both runs replay the same events and answer the same."""
    streams, real = [], allocator.replay_with_min_capacity

    def spy(events, *args, **kwargs):
        streams.append(list(events))
        return real(events, *args, **kwargs)

    results = []
    allocator.replay_with_min_capacity = spy
    try:
        for on in (False, True):
            setattr(simulate, switch, on)
            results.append(simulate_step(model, shape, batch, dtype, **setup))
    finally:
        setattr(simulate, switch, True)
        allocator.replay_with_min_capacity = real
    test.assertEqual(streams[0], streams[1])
    test.assertEqual(results[0], results[1])

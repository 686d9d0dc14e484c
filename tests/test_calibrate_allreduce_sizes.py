"""A CPU calibration times the all-reduce past the link's sizes, up to the first power of two that holds its largest
stage's gradients (what a REDUCE row all-reduces in one call), in a host cache entry keyed by those sizes: a model
that needs no more reuses it, one that needs more measures the sizes that cover it."""

import torch

from pipesim.profiles.linkfit import LinkPoint, LinkPoints

LINK_SIZES = [4096, 65536]


def test_sizes_covering_are_powers_of_two_past_the_link_up_to_the_gradients():
    from pipesim.calibrate.measure import sizes_covering

    assert sizes_covering(LINK_SIZES, 65536) == []
    assert sizes_covering(LINK_SIZES, 65537) == [131072]
    assert sizes_covering(LINK_SIZES, 4_200_000) == [131072, 262144, 524288, 1 << 20, 1 << 21, 1 << 22, 1 << 23]


def test_the_all_reduce_is_timed_up_to_the_largest_stage_gradients_once_per_sizes(tmp_path, monkeypatch):
    """Three models on one cache: the second's gradients need the first's sizes (reused), the third's one more
    power of two (measured). Each profile's all-reduce has a point at or past its stage's gradients and says what
    its points cover and where they came from."""
    import pipesim.calibrate.measure as measure
    from pipesim.calibrate.cache import HostCache
    from pipesim.workload.models import build_model

    measured = []

    def allreduce(sizes, **_):
        measured.append(list(sizes))
        return LinkPoints([LinkPoint(s, 0.01 + s / 1e6, 0.0) for s in sizes], {"world_size": 2})

    monkeypatch.setattr(measure, "measure_p2p_and_allreduce", lambda sizes, **_: tuple(
        LinkPoints([LinkPoint(s, 0.01 + s / 1e6, 0.0) for s in sizes], {"world_size": 2}) for _ in range(2)))
    monkeypatch.setattr(measure, "measure_allreduce", allreduce)
    monkeypatch.setattr(measure, "measure_allreduce_beside_compute", lambda nbytes, **_: {
        "beside_compute": [1.0, 1.5, 2.0], "beside_compute_points": [], "beside_compute_workload": {}})
    settings = measure.Settings(torch.device("cpu"), torch.float32, 4, warmup=0, repeats=1)
    profiles = [measure.calibrate(build_model("mlp", layers=3, width=width), settings, stages=1, optimizer="sgd",
                                  memory_cap_bytes=None, link_sizes=LINK_SIZES, dtype_name="float32",
                                  advance=lambda what: None, cache=HostCache(tmp_path))
                for width in (120, 160, 180)]
    gradients = [p.stages[0].param_bytes for p in profiles]  # one stage: the whole model's
    assert 131072 < gradients[0] < gradients[1] <= 262144 < gradients[2] <= 524288
    assert measured == [[131072, 262144], [131072, 262144, 524288]]
    for profile, nbytes in zip(profiles, gradients):
        covering = profile.allreduce.meta["sizes_covering"]
        assert max(p.nbytes for p in profile.allreduce.points) == covering["covers_bytes"] >= nbytes
        assert [p.nbytes for p in profile.allreduce.points][:2] == LINK_SIZES
    assert [p.allreduce.meta["sizes_covering"]["host_cache"]["reused"] for p in profiles] == [False, True, False]

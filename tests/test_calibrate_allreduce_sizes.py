"""A CPU calibration times the all-reduce past the link's sizes, up to the first power of two that holds its largest
stage's gradients (what a REDUCE row all-reduces in one call), in host cache entries keyed by the size their powers
start past: a model whose gradients an entry covers reuses it, one that needs more measures only the sizes past it."""

import re
from contextlib import contextmanager

import torch

from pipesim.profiles.linkfit import LinkPoint, LinkPoints

LINK_SIZES = [4096, 65536]


def test_sizes_covering_are_powers_of_two_past_the_link_up_to_the_gradients():
    from pipesim.calibrate.measure import sizes_covering

    assert sizes_covering(LINK_SIZES, 65536) == []
    assert sizes_covering(LINK_SIZES, 65537) == [131072]
    assert sizes_covering(LINK_SIZES, 4_200_000) == [131072, 262144, 524288, 1 << 20, 1 << 21, 1 << 22, 1 << 23]


def test_the_all_reduce_past_the_link_reuses_what_covers_and_measures_only_the_sizes_past_it(tmp_path, monkeypatch):
    """Models on one cache: the second's gradients need the first's sizes (the same: reused), the third's one size
    fewer (reused, up to its size), the fourth's one more (the kept ones reused, the one past them measured), the
    fifth's the third's again; --fresh measures them all again. Each profile's all-reduce has points up to the first
    power of two at or past its stage's gradients, and each of its host cache entries says which it gave. The
    progress names the sizes in KiB and MiB ("4335616 bytes" was left to count)."""
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
    lines = []

    @contextmanager
    def phase(title):
        notes = []
        yield notes
        lines.append(" ".join([title, *notes]))

    settings = measure.Settings(torch.device("cpu"), torch.float32, 4, warmup=0, repeats=1)
    profiles = [measure.calibrate(build_model("mlp", layers=3, width=width), settings, stages=1, optimizer="sgd",
                                  memory_cap_bytes=None, link_sizes=LINK_SIZES, dtype_name="float32",
                                  advance=lambda what: None, cache=HostCache(tmp_path, fresh=fresh), phase=phase)
                for width, fresh in ((120, False), (160, False), (100, False), (180, False), (100, False),
                                     (180, True))]
    gradients = [p.stages[0].param_bytes for p in profiles]  # one stage: the whole model's
    assert 65536 < gradients[2] <= 131072 < gradients[0] < gradients[1] <= 262144 < gradients[3] <= 524288
    assert measured == [[131072, 262144], [524288], [131072, 262144, 524288]]
    past = [line for line in lines if line.startswith("timing the all-reduce past")]
    assert past[1].startswith(f"timing the all-reduce past the link's sizes, up to 256 KiB (a stage's gradients: "
                              f"{gradients[1] / 1024:.4g} KiB) 128 KiB to 256 KiB from the host cache"), past[1]
    assert not [line for line in lines if re.search(r"\d{4}", line.replace(",", ""))], lines
    kept = [[(part["sizes"], part["reused"]) for part in p.allreduce.meta["sizes_covering"]["host_cache"]]
            for p in profiles]
    assert kept == [[([131072, 262144], False)], [([131072, 262144], True)], [([131072], True)],
                    [([131072, 262144], True), ([524288], False)], [([131072], True)],
                    [([131072, 262144, 524288], False)]]
    for profile, nbytes in zip(profiles, gradients):
        covering = profile.allreduce.meta["sizes_covering"]
        sizes = [p.nbytes for p in profile.allreduce.points]
        assert sizes == [*LINK_SIZES, *covering["sizes"]] and sizes[-1] == covering["covers_bytes"] >= nbytes > \
            sizes[-2]

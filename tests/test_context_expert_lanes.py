"""A pass's all-to-alls and its context ring: the device's next pass waits for both. The ring ran on a lane of its
own (NVLink, where the replicas' collectives cross nodes), the next row waited for the run's last row, the ring,
which ended first, and the next pass ran under the all-to-alls: Qwen3-30B-A3B at C = 2, E = 4 stepped in 2,465 ms
against 6,659 at C = 1 on half the GPUs."""

import json

from tests.conftest import pipesim

MOE_CP = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 1024,
          "--vocab", 1000, "--experts", 4, "--attention", "flash", "--context-parallel", 2, "--expert-parallel", 2,
          "--data-parallel", 4, "-p", 2, "-m", 4, "-s", "1f1b")


def test_the_pass_after_an_all_to_all_waits_for_it_beside_a_context_ring(tmp_path):
    code, _, err = pipesim("simulate", *MOE_CP, "--trace", tmp_path / "t.json")
    assert code == 0, err
    events = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    kinds = {e.get("cat") for e in events}
    assert {"A2A_F", "A2A_B", "RING_F", "RING_B"} <= kinds  # both runs are rows of the order
    for device in {e["pid"] for e in events}:
        passes = sorted(e["ts"] for e in events if e["pid"] == device and e.get("cat") in ("F", "B", "I", "W"))
        for a2a in (e for e in events if e["pid"] == device and e.get("cat", "").startswith("A2A")):
            following = [start for start in passes if start >= a2a["ts"]]
            assert not following or following[0] >= a2a["ts"] + a2a["dur"] - 1e-6, (device, a2a["name"])

"""What several test modules build alike, built once here: the part they price on."""

from __future__ import annotations

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import Device

H100 = load_catalogue().find("h100-sxm")
H100_BF16 = Device.of(H100, "bf16")

"""Which Ray cluster the driver uses: ray_address, else RAY_ADDRESS, else a local one."""
from omegaconf import OmegaConf

from qwen35rl.runtime.cluster import ray_address


def test_ray_address_precedence(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(OmegaConf.create({"ray_address": None})) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address(OmegaConf.create({"ray_address": None})) == "10.0.0.1:6379"
    assert ray_address(OmegaConf.create({"ray_address": "auto"})) == "auto"

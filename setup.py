"""Ships the top-level Hydra tree `conf/` inside the wheel as the data package `qwen35rl.conf`."""
import os

from setuptools import find_packages, setup

conf_packages = ["qwen35rl.conf"] + [
    "qwen35rl.conf." + os.path.relpath(d, "conf").replace(os.sep, ".")
    for d, _, _ in os.walk("conf") if d != "conf" and "__pycache__" not in d
]
setup(
    # hydra_plugins.qwen35rl_submitit: the submitit launchers of `qwen35rl-train -m hydra/launcher=submitit_slurm`
    packages=find_packages(include=["qwen35rl", "qwen35rl.*"]) + conf_packages + ["hydra_plugins.qwen35rl_submitit"],
    package_dir={"qwen35rl.conf": "conf"},
    package_data={p: ["*.yaml"] for p in conf_packages},
    include_package_data=False,
)

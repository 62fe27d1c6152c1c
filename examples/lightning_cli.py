"""LightningCLI with layerckpt switched on from YAML.

    python examples/lightning_cli.py fit --config examples/lightning_config.yaml
"""
from lightning.pytorch.cli import LightningCLI

from layerckpt.bench.lightning_workload import FineTuneModule

if __name__ == "__main__":
    LightningCLI(FineTuneModule)

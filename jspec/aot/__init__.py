"""Compile jspec for TPU slices from any machine (libtpu's compiler, abstract weights) and
report per chip what fits and what a step reads: `python -m jspec aot --help`."""

from jspec.aot.chips import CHIPS, Chip, chip_of, tpu_devices, tpu_mesh
from jspec.aot.report import Compiled, compile_program, model_config, report, setup, table

__all__ = ["CHIPS", "Chip", "Compiled", "chip_of", "compile_program", "model_config", "report",
           "setup", "table", "tpu_devices", "tpu_mesh"]

"""Checkpoints: Orbax save and restore, their checksums, and reading them without resuming.

  checkpointer  `Checkpointer`: async save, restore onto any mesh, damaged step directories and the fallback
  integrity     the checksums of array chunks and of the meta item, and what a failed restore names
  orbax_output  where the output of Orbax's threads goes (WORKDIR/diagnostics/ logs, not the terminal)
  reader        `checkpoint_steps`, `run_meta`, `task_of`, `load_params`, `read_params`, `param_reader`: steps,
                meta items and parameters of a run, without resuming it
  resume        the checks a checkpoint passes before a run resumes it; resume, fine-tune or start fresh
  init_from     `--config.init_from`: the checkpoint a fine-tuning run starts from

`resume` and `init_from` import the train step and the data layer: the train loop imports them itself.
"""
from meshtrain.checkpoint.checkpointer import REQUIRED, Checkpointer, register_handler
from meshtrain.checkpoint.reader import (
                                         StepVanished,
                                         checkpoint_steps,
                                         load_params,
                                         param_reader,
                                         read_params,
                                         retrying,
                                         run_meta,
                                         task_of,
)

__all__ = ["Checkpointer", "REQUIRED", "register_handler", "StepVanished", "checkpoint_steps", "load_params",
           "param_reader", "read_params", "retrying", "run_meta", "task_of"]

"""The LM recipe: a Llama-style decoder trained on a mesh, in files a reader copies.

Run it as a module from the folder that holds ``jaxdist_lm/``, or anywhere once the
project is installed::

    python -m jaxdist_lm.train --model tiny --mesh data=2,fsdp=2,tensor=2 --steps 20
    python -m jaxdist_lm.convert from-hf HF_DIR CHECKPOINT_DIR

Its modules import each other relatively (``from . import model_config``), so a copy
under another name runs as ``python -m NAME.train``; it imports nothing of the book's
companion package.

train.py sets up and runs the loop. Beside it: command_line.py (its flags),
run_config.py (every flag, typed and frozen), model_config.py (the shape, the presets,
config.json), model.py (the decoder, in Flax NNX), loss.py (the next-token loss, the
logits a chunk at a time), layers.py (what model.py and experts.py share: the axes'
names, the MLP), attention.py (the attention kernels; splash.py the TPU's), experts.py
(the mixture of experts, its router and capacity), dropless.py (each device's share of
the experts without a capacity), data.py (tokens read in place, with Grain),
mesh_spec.py (--mesh's axes and sizes, the rules, what splits evenly), layout.py (the
mesh, the check that stops a mesh in one line), step.py (train_step, one optimizer step;
the loss, gradients, accumulation, ZeRO-1 and the optimizer's offload), inputs.py (what
the loss takes in: inputs and targets, the weights cast, micro-batches), optimizer.py
(AdamW, Adam's moments in --moments' dtype), pipeline.py (the model cut into stages,
and the schedules that run them), schedules.py (their timetables), resilience.py
(preemption, the step deadline, checkpoints), metrics.py (MFU, the metrics log),
compiled.py (--compile-only; hlo_dtypes.py its bytes per element type) and convert.py
(Hugging Face's checkpoints; hf_tensors.py their tensors and files).
"""

"""The training view's look inside a flagged step (--rerun-mode validate_results, engine/rerun.py).

When the engine flags a step it calls, in order: `flagged` (the flagged execution's gradients
are still in the main-grad buffers: their per-layer norms are queued on the device), `replaying`
around the rerun (a forward hook on every layer block sums the RMS of its output, on the device)
and `classified` with the verdict (the rerun's per-layer grad norms are queued). A `train_rerun`
message then compares the two executions layer by layer: for a transient fault the layer whose
gradient norm differs most is where the values went wrong; for a reproducible one the rerun's
activations show the layer where they grow. Nothing waits for the device on the training
thread: the reporter thread reads the numbers.
"""

from __future__ import annotations

import contextlib

import torch

from megatronapp.scope_ui import protocol as P


class FlaggedStepReplay:
    def __init__(self, trainer, norms, post):
        """`norms`: the view's LayerNorms; `post(make_message)`: queue for the reporter thread."""
        self.norms, self.post = norms, post
        self.num_layers = trainer.job.model.num_layers
        self.blocks = [(int(i), block) for c in trainer.chunks for i, block in c.layers.items()]
        self.device = next(trainer.chunks[0].parameters()).device
        self._flagged = None
        self._act_sq, self._calls = None, [0] * self.num_layers

    def flagged(self, iteration: int, flags) -> None:
        self._flagged = (tuple(flags), self.norms.start())

    @contextlib.contextmanager
    def replaying(self, iteration: int):
        self._act_sq, self._calls = torch.zeros(self.num_layers, device=self.device), [0] * self.num_layers
        handles = [block.register_forward_hook(self._recorder(layer)) for layer, block in self.blocks]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _recorder(self, layer: int):
        def record(module, args, output) -> None:
            out = output[0] if isinstance(output, tuple) else output
            self._act_sq[layer] += out.detach().float().pow(2).mean()  # summed over microbatches
            self._calls[layer] += 1

        return record

    def classified(self, iteration: int, report: dict) -> None:
        flags, flagged = self._flagged
        rerun = self.norms.start()
        rms = (self._act_sq / torch.tensor([max(1, n) for n in self._calls], device=self.device)).sqrt()

        def message() -> P.TrainRerun:  # on the reporter thread: the waits happen there
            return P.TrainRerun(
                iteration=iteration,
                flags=list(flags),
                verdict=report["verdict"],
                ranks=report["ranks"],
                layer_grad_norms_flagged=self.norms.finish(flagged)[1],
                layer_grad_norms_rerun=self.norms.finish(rerun)[1],
                layer_act_rms_rerun=rms.tolist(),
            )

        self.post(message)

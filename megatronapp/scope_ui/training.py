"""`train --scope`: the training view, plugged in through the trainer's on_step callback.

    with training_scope(scope, tokenizer_model, trainer, on_step) as on_step:   # unchanged when scope is None
        trainer.train(on_step=on_step)

After each reported step (every --log-interval steps; use 1 for a live view) the wrapped
callback: queues the per-layer weight and gradient norms on the device (no host sync; the
`reporter` thread waits for them and sends them with loss / LR / grad norm, so a step
without a probe only pays for launching two fused norm kernels); every K steps runs the
probe prompt through the same chunk (eval mode, no grad) with a capture and posts its top-k,
attention and per-layer activation statistics (encoded on the server's thread); swaps in the
perturbations set from the page (active from the next step; parameter faults restored when
removed); and blocks while the page has paused training ("step" lets exactly one more step
run). Step reports and the training thread's state changes go through the one reporter
queue, so the page never sees "waiting after step N" before step N itself.
One process only (PP 1, TP 1, DP 1): the page talks to the process holding the whole model.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading

from megatronapp.scope_ui.cli import TrainingScopeConfig

HISTORY = 5000  # training steps replayed to a tab that connects late


@contextlib.contextmanager
def training_scope(scope: TrainingScopeConfig | None, tokenizer_model: str | None, trainer, on_step):
    """`on_step`, wrapped with the UI when `scope` is set; the server stops on exit."""
    if scope is None:
        yield on_step
        return
    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.scope_ui.cli import server_config
    from megatronapp.scope_ui.server import Hub, RunningServer

    cfg = server_config(scope.host, scope.port, scope.token)
    backend = TrainingScope(
        trainer,
        load_tokenizer(tokenizer_model),
        scope.probe,
        scope.every,
        cfg.limits.max_perturbations,
        paused=scope.start_paused,
    )
    hub = Hub(backend, cfg.limits)
    backend.hub = hub
    server = RunningServer(hub, cfg).start()
    print(f"MegaScope training view: {server.url}", flush=True)
    try:
        yield backend.wrap(on_step)
    finally:
        backend.close()
        server.stop()


def check_training_scope(scope: TrainingScopeConfig | None, world: int) -> None:
    """`train --scope` on `world` ranks; one-line ConfigError."""
    from megatronapp.config import ConfigError

    if scope is None:
        return
    if world != 1:
        raise ConfigError("--scope serves one training process; run without --nproc-per-node (world size 1)")
    if scope.every < 1:
        raise ConfigError(f"--scope-every must be >= 1, got {scope.every}")
    if not 0 <= scope.port < 65536:
        raise ConfigError(f"port must be in 0..65535, got {scope.port}")


class TrainingScope:
    mode = "train"

    def __init__(self, trainer, tokenizer, probe: str, every: int, max_perturbations: int, paused: bool = False):
        from megatronapp.scope.target import resolve_target
        from megatronapp.scope_ui.probe import LayerNorms
        from megatronapp.scope_ui.runner import PerturbationSet, describe_model

        self.trainer, self.tokenizer, self.every, self.hub = trainer, tokenizer, every, None
        self.probe_tokens = tokenizer.encode(probe)[: trainer.job.model.seq_length - 1] or [0]
        target = resolve_target(trainer.chunks)
        self.named_params = target.named_params()
        self.norms = LayerNorms(self.named_params, trainer.job.model.num_layers)
        shapes = target.full_param_shapes()
        self.info = describe_model(trainer.job.model, shapes)
        self.perturbations = PerturbationSet(trainer.job.model, shapes, max_perturbations)
        self._active, self._stack = [], contextlib.ExitStack()
        self.cond = threading.Condition()
        self.paused, self.steps_allowed, self.closed = paused, 0, False
        self.history = collections.deque(maxlen=HISTORY)  # TrainStep messages a new tab is sent first
        self.reruns = collections.deque(maxlen=HISTORY)  # and the TrainRerun messages
        self.evals = collections.deque(maxlen=HISTORY)  # and the TrainEval messages
        self.history_lock = threading.Lock()
        self.reports: queue.Queue = queue.Queue()  # (metrics, pending norms) or a message; None ends
        self.reporter = threading.Thread(target=self._report_loop, name="scope-train-report", daemon=True)
        self.reporter.start()
        if trainer.job.integrity.rerun_mode == "validate_results":  # a flagged step's rerun, layer by layer
            from megatronapp.scope_ui.replay import FlaggedStepReplay

            trainer.replay_observer = FlaggedStepReplay(trainer, self.norms, self.reports.put)
        trainer.eval_observer = self.after_eval  # validation / test losses: the loss curve's second series

    def welcome_fields(self) -> dict:
        from megatronapp.scope_ui.runner import welcome_fields

        return welcome_fields(self.info)

    def backlog(self) -> list:
        from megatronapp.scope_ui import protocol as P

        with self.history_lock:
            steps = list(self.history) + list(self.reruns) + list(self.evals)
        return [*steps, P.TrainState(paused=self.paused, waiting=False, iteration=self.trainer.iteration)]

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # -- page controls (event-loop thread) -------------------------------------------------
    def control(self, action: str) -> None:
        with self.cond:
            self.paused = action != "resume"
            self.steps_allowed = 1 if action == "step" else 0
            self.cond.notify_all()
        if self.hub is not None:
            self.hub.broadcast(self._state(waiting=False))

    def _state(self, waiting: bool):
        from megatronapp.scope_ui import protocol as P

        return P.TrainState(paused=self.paused, waiting=waiting, iteration=self.trainer.iteration)

    # -- reporter thread: waits for the norms, sends in order -------------------------------
    def _report_loop(self) -> None:
        while (job := self.reports.get()) is not None:
            if self.hub is None:
                continue
            if isinstance(job, tuple):
                self.hub.broadcast(self._train_step(*job))
            elif callable(job):  # a flagged step's message, built here where waiting for the device is fine
                message = job()
                with self.history_lock:
                    self.reruns.append(message)
                self.hub.broadcast(message)
            else:
                self.hub.broadcast(job)

    def _train_step(self, metrics, pending):
        from megatronapp.scope_ui import protocol as P

        weights, grads = self.norms.finish(pending)
        step = P.TrainStep(
            iteration=metrics.iteration,
            loss=metrics.loss,
            lr=metrics.lr,
            grad_norm=metrics.grad_norm,
            layer_weight_norms=weights,
            layer_grad_norms=grads,
        )
        with self.history_lock:
            self.history.append(step)
        return step

    # -- training thread -------------------------------------------------------------------
    def after_eval(self, result) -> None:
        """An evaluation's result (engine/evaluation.py's EvalResult), sent after the steps before it."""
        from megatronapp.scope_ui import protocol as P

        message = P.TrainEval(split=result.name, iteration=result.iteration, loss=result.loss, ppl=result.ppl)
        with self.history_lock:
            self.evals.append(message)
        self.reports.put(message)

    def wrap(self, on_step):
        def scoped_on_step(metrics) -> None:
            on_step(metrics)
            self.after_step(metrics)

        return scoped_on_step

    def after_step(self, metrics) -> None:
        from megatronapp.scope_ui.probe import run_probe

        self.reports.put((metrics, self.norms.start()))
        if metrics.iteration % self.every == 0:
            run_probe(self.trainer, self.tokenizer, self.probe_tokens, metrics.iteration, self.hub)
        self._swap_perturbations()
        self._wait_while_paused()

    def _swap_perturbations(self) -> None:
        from megatronapp.scope import perturb

        wanted = list(self.perturbations.specs)
        if wanted == self._active:
            return
        self._stack.close()  # parameter faults get their original bits back here
        self._stack = contextlib.ExitStack()
        for spec in wanted:
            self._stack.enter_context(perturb(self.trainer.chunks, spec))
        self._active = wanted

    def _wait_while_paused(self) -> None:
        with self.cond:
            if self.paused:
                self.reports.put(self._state(waiting=True))
            while self.paused and not self.closed:
                if self.steps_allowed:
                    self.steps_allowed -= 1
                    return
                self.cond.wait(timeout=0.5)

    def close(self) -> None:
        self.trainer.replay_observer = None
        self.trainer.eval_observer = None
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.reports.put(None)
        self.reporter.join(timeout=30)
        self._stack.close()

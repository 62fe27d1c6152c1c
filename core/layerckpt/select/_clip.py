"""The loss a framework adapter hands a save's selection: :class:`SelectionLoss`.

The selection skips a layer whose estimated loss increase fits in ``Config.fidelity`` times the loss it is
given, and it prices that increase with the optimizer's running averages of the gradients.  Where training
clips its gradients by norm, those are averages of the clipped gradients, short of the loss's own gradient by
the clipping's factor, and so is every price; scaled by the plain loss, the allowance then lets a restore give
up that factor's inverse times what fidelity promises.  The adapters (transformers, Lightning, accelerate)
record each optimizer step's loss and its gradient norm before clipping here, and hand over the interval's
mean loss put in the unit of the clipped gradients.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch


class SelectionLoss:
    """The training loss of the optimizer steps since the last save, in the unit of the gradients the
    optimizer was given.  Per micro-batch :meth:`add` its loss, per optimizer step :meth:`clipped` its
    gradient norm before clipping (where the step clipped or measured one) and :meth:`step_done` once the
    step ended; at a save, :meth:`take` the loss its selection is scaled by.

    Losses stay tensors (no device sync per step); :meth:`take` reads the norms once per save.
    """

    def __init__(self) -> None:
        #: the loss the last :meth:`take` returned
        self.loss: Optional[torch.Tensor] = None
        self._step_loss: Any = None  # summed over the micro-batches of the step under way
        #: the step under way's squared gradient norm before clipping, and the part of it clipping kept
        #: (``min(norm, max_norm) * norm``); None where no norm was measured
        self._step_clip: Optional[Tuple[Any, Any]] = None
        #: over the optimizer steps since the last take: the sum of their losses, of their two squares above
        self._losses: Any = None
        self._clips: Tuple[Any, Any] = (0.0, 0.0)
        self._steps = 0

    def add(self, loss: Any) -> None:
        """A micro-batch's loss, in the unit whose sum over a step's micro-batches is the step's loss (already
        divided for gradient accumulation).  Anything but a one-element tensor or a number is ignored."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                return
            loss = loss.detach().reshape(())
        elif not isinstance(loss, (int, float)) or isinstance(loss, bool):
            return
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss

    @property
    def in_step(self) -> bool:
        """Whether a loss was added since the last :meth:`step_done`."""
        return self._step_loss is not None

    def clipped(self, norm: Any, max_norm: Any) -> None:
        """The step under way's gradients had ``norm`` before clipping, and were clipped to at most
        ``max_norm`` (``inf`` or <= 0: measured only); the optimizer got them scaled by ``min(1, max_norm /
        norm)``.  The step's last call counts.  A norm that is not a number or a one-element tensor (a
        DTensor's is read in full) is ignored."""
        try:
            limit = float(max_norm)
        except (TypeError, ValueError):
            return
        if isinstance(norm, torch.Tensor):
            full = getattr(norm, "full_tensor", None)  # a DTensor (FSDP2, tensor parallel)
            norm = full() if callable(full) else norm
            if norm.numel() != 1:
                return
            norm = norm.detach().float().reshape(())
        elif not isinstance(norm, (int, float)) or isinstance(norm, bool):
            return
        elif not math.isfinite(norm):
            return  # an overflowed step (a mixed-precision scaler skips it)
        square = norm * norm
        if not limit < float("inf") or limit <= 0:
            kept = square  # a norm measured, nothing clipped
        elif isinstance(norm, torch.Tensor):
            kept = norm.clamp(max=limit) * norm
        else:
            kept = min(norm, limit) * norm
        if isinstance(norm, torch.Tensor):  # an overflowed step counts for nothing, read without a sync
            finite = torch.isfinite(norm)
            square, kept = torch.where(finite, square, 0.0), torch.where(finite, kept, 0.0)
        self._step_clip = (square, kept)

    def step_done(self) -> None:
        """An optimizer step ended: its loss and its gradient norms join those of the interval the next save's
        selection is scaled by (a step without a loss joins nothing)."""
        if self._step_loss is not None:
            self._losses = self._step_loss if self._losses is None else self._losses + self._step_loss
            if self._step_clip is not None:
                self._clips = (self._clips[0] + self._step_clip[0], self._clips[1] + self._step_clip[1])
            self._steps += 1
        self._step_loss, self._step_clip = None, None

    def take(self) -> Optional[torch.Tensor]:
        """The loss a save's selection is scaled by (its allowance is ``Config.fidelity`` times it), over the
        optimizer steps since the last take: their mean training loss, times the factor by which gradient
        clipping scaled their gradients.  The selection prices a stale layer with the optimizer's gradient
        averages, which are averages of the clipped gradients: they fall short of the loss's own gradient by
        that factor, and so does every price; the loss is put in the same unit.  Each step's gradient weighs
        in a price by its squared norm (the update it drove is along it), so the factor is the share of the
        steps' squared norms clipping kept, ``sum(min(n, max) * n) / sum(n * n)``: 1 where nothing was
        clipped.  The mean loss over the interval, not the last step's: one batch's loss swings the allowance
        by tens of percent.  Without a step since the last take: the last take's."""
        if self._steps:
            raw, kept = (float(x) for x in self._clips)  # one sync per save
            mean = self._losses / self._steps
            if not isinstance(mean, torch.Tensor):
                mean = torch.tensor(float(mean))
            self.loss = mean * (kept / raw if raw > 0 else 1.0)
            self._losses, self._clips, self._steps = None, (0.0, 0.0), 0
        return self.loss

"""The interface every part of `SparseAdamW` answers. The optimizer is composed of the parts named in
`SparseAdamW.PARTS`, and that list is the only one: the per-step reset, `state_dict`, `load_state_dict` and
copies (pickle, `copy.deepcopy`) iterate it, so a part a subclass swaps in takes part in each. Each part is built with
the optimizer's `Settings` and reads them from there, not back off the optimizer."""

from __future__ import annotations

from typing import Any

from sift.optim.settings import Settings


class Part:
    """One named part of `SparseAdamW`, built with the optimizer and again for each copy (`_build_parts`), given
    the optimizer's settings (`self.settings`, a `sift.optim.settings.Settings`; a load hands it the checkpoint's
    through `adopt`).

    What a part keeps for one step only, `new_step` forgets. What decides how training continues goes in
    `saved` (written under `state_dict()["sift"]`, read back by `resume`) and, for a copy of this process's
    optimizer, in `carried` (read back by `carry`). Everything else a part holds lives with this process
    (hooks, kernel tables) and is built again for a copy. The defaults keep nothing.

    Example:
        >>> class CountedSteps(Part):
        ...     def __init__(self, opt, settings):
        ...         super().__init__(opt, settings)
        ...         self.steps = 0
        ...     def new_step(self):
        ...         self.steps += self.settings.select_steps
        ...     def saved(self):
        ...         return {"counted_steps": self.steps}
        ...     def resume(self, saved):
        ...         self.steps = saved.get("counted_steps", 0)
        >>> part = CountedSteps(None, Settings(select_steps=2))
        >>> part.new_step()
        >>> part.saved()
        {'counted_steps': 2}
    """

    def __init__(self, opt: Any, settings: Settings) -> None:
        self.opt = opt
        self.settings = settings

    def adopt(self, settings: Settings) -> None:
        """`load_state_dict` adopted a checkpoint's settings (`Settings.adopting`): read these from now on."""
        self.settings = settings

    def new_step(self) -> None:
        """Forget what lived for one step only: after every step (run or skipped), and in `zero_grad`."""

    def saved(self) -> dict[str, Any]:
        """What `state_dict` records of this part, under its "sift" entry (keys shared by every part: name
        them after the part)."""
        return {}

    def resume(self, saved: dict[str, Any]) -> None:
        """`load_state_dict`, once the state is validated and installed: continue from `saved` (the state_dict's
        "sift" entry, which may come from a version that wrote none of this part's keys). Must not refuse."""

    def carried(self) -> dict[str, Any]:
        """What a copy of the optimizer (pickle, `copy.deepcopy`) carries of this part."""
        return {}

    def carry(self, carried: dict[str, Any]) -> None:
        """Rebuild a copy's part, just built, from what `carried` gave."""

"""`SparseAdamW`'s settings: what its constructor fixed, handed to every part when it is built.

A part reads `self.settings.x`, never the optimizer's attribute of that name (which stays as a read-only view for
users). What changes while training is no setting and has one owner instead: whether weights step inside backward
(`memory`), the process group (`grads`), the GradScaler link (`amp`).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Settings:
    """The constructor's settings, validated (see `SparseAdamW` for each). Frozen: a load adopts a checkpoint's
    selection settings and state layout as a new object (`adopting`), handed to every part again.

    Example:
        >>> adopted = Settings(select_steps=2, compact_grads=True).adopting({"selection": "random", "state": "lean"})
        >>> adopted.selection, adopted.state_layout, adopted.select_steps, adopted.compact_grads
        ('random', 'lean', 2, True)
    """

    select_steps: int = 1
    selection: str = "magnitude"
    seed: int = 0
    compact_grads: bool = False
    state_layout: str = "exact"
    backend: str | None = None
    max_grad_norm: float | None = None
    sharded_selection: str = "global"

    def adopting(self, saved: dict[str, Any]) -> Settings:
        """These settings with a state_dict's "sift" entry over them: the ones a checkpoint decides (the state
        layout under its key "state"); the rest (the mode, clipping, the backend) stay as constructed."""
        return dataclasses.replace(
            self, state_layout=saved.get("state", "exact"), select_steps=saved.get("select_steps", self.select_steps),
            selection=saved.get("selection", self.selection), seed=saved.get("seed", self.seed),
            sharded_selection=saved.get("sharded_selection", self.sharded_selection))


NAMES = tuple(field.name for field in dataclasses.fields(Settings))


def setting_view(name: str) -> property:
    """The optimizer's read-only attribute `name`: its setting, as users read it."""
    return property(lambda opt: getattr(opt.settings, name), doc=f"The `{name}` setting (`sift.optim.settings`).")

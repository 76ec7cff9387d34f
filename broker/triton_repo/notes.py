"""What one model's file asks that tgw does not honour: warnings (answers unchanged) and refusals
(ignoring it would change answers), each naming its field."""
from __future__ import annotations


class Notes:
    def __init__(self, model: str):
        self.model = model
        self.ignored: list[str] = []     # "field (why)", joined into one warning
        self.refusals: list[str] = []    # "model M: field F: why"

    def warn(self, field: str, why: str) -> None:
        self.ignored.append(f"{field} ({why})")

    def refuse(self, field: str, why: str) -> None:
        self.refusals.append(f"model {self.model}: {field}: {why}")

    def warning(self) -> list[str]:
        """The one warning of this model, or none."""
        return [f"model {self.model}: not honoured: " + "; ".join(self.ignored)] if self.ignored else []

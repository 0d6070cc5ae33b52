"""A registry of classes by name: what proposers (drafting methods) and verification policies
use, so that a new method or policy is a new file that registers itself, and the engine never
branches on names. A leaf module (imports nothing of draftwise)."""
from __future__ import annotations


class Registry:
    def __init__(self, what: str, also: str = ""):
        self.what = what  # e.g. "speculative method", named in errors
        self.also = also  # e.g. " or none": other accepted values, for the error message
        self._classes: dict[str, type] = {}

    def register(self, name: str):
        """Class decorator: `@REGISTRY.register("draft")`; sets `cls.name`."""
        def deco(cls):
            self._classes[name] = cls
            cls.name = name
            return cls

        return deco

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str):
        if name not in self._classes:
            raise ValueError(f"{self.what} must be one of {', '.join(self.names())}{self.also}, got {name!r}")
        return self._classes[name]

"""The training corpus under its former name: `draftwise.corpus` re-exported (lab reads it too)."""
from ..corpus import EXCLUDED_DIRS, HELD_OUT, Split, is_held_out, list_files, split, stdlib_root

__all__ = ["EXCLUDED_DIRS", "HELD_OUT", "Split", "is_held_out", "list_files", "split", "stdlib_root"]

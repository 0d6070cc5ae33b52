"""The flat verification metadata, built by hand."""
import torch

from draftwise.engine import VerifyBatch
from draftwise.proposers import DraftBlock


def test_ragged_batch_offsets_and_padding():
    vb = VerifyBatch.build([DraftBlock([5, 6, 7], None), DraftBlock([], None), DraftBlock([9], None)])
    assert vb.num_draft == [3, 0, 1]
    assert vb.cu_num_logits == [0, 4, 5, 7]
    assert vb.max_k == 3
    assert vb.draft_token_ids.tolist() == [[5, 6, 7], [0, 0, 0], [9, 0, 0]]
    flat = torch.arange(7, dtype=torch.float32)[:, None].repeat(1, 2)  # row i holds value i
    padded = vb.pad_rows(flat)  # [3, 4, 2]
    assert padded[:, :, 0].tolist() == [[0, 1, 2, 3], [4, 4, 4, 4], [5, 6, 6, 6]]

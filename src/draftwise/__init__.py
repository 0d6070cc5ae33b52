"""draftwise: a speculative-decoding engine and lab."""

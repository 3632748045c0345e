"""N-gram prompt lookup: guess a sequence's next tokens from its own earlier text, with no draft model.

The last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up in the tokens
before them; at the latest earlier occurrence, the (up to) ``k`` tokens that followed it are the
proposal. Outputs that copy spans of their prompt (a record rewritten with one field changed, a passage
quoted back, a code edit) repeat long runs that this finds.
"""

import numpy as np


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix.

    The suffix lengths tried are ``max_n`` down to ``min_n``; an empty list when none occurs earlier.
    """
    num_tokens = len(token_ids)
    if k <= 0 or num_tokens <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)  # [num_tokens]
    last = tokens[-1]
    # Candidate ends: earlier positions holding the last token (the suffix's own end excluded).
    ends = np.flatnonzero(tokens[:-1] == last)[::-1]  # [num_candidates], latest first
    if ends.size == 0:
        return []
    best_end, best_len = -1, 0
    for end in ends.tolist():
        # Length of the match ending at ``end`` against the suffix, capped at max_n.
        length = 1
        limit = min(max_n, end + 1)
        while length < limit and token_ids[end - length] == token_ids[num_tokens - 1 - length]:
            length += 1
        if length > best_len:
            best_end, best_len = end, length
            if length == max_n:
                break
    if best_len < min_n:
        return []
    return token_ids[best_end + 1 : best_end + 1 + k]

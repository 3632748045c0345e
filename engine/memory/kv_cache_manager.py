"""Each sequence's KV blocks in the page pool, with automatic prefix caching over full blocks."""

import hashlib
from array import array

from engine.memory.page_pool import PagePool
from engine.scheduling.sequence import Sequence, block_id_array

ROOT_HASH = b"loraplex-kv-v1"  # the parent of a sequence's first block (of one without a cache salt)


def block_hash(parent: bytes, token_ids: list[int], adapter_digest: bytes = b"") -> bytes:
    """Chain hash of one full block: it names the block's tokens and every token before them.

    The adapter's content digest is part of the chain, so two adapters never share KV and a
    re-uploaded adapter (a new digest) never reuses the old version's blocks.
    """
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    digest.update(adapter_digest)
    return digest.digest()


def root_hash(cache_salt: str | None) -> bytes:
    """The parent of a sequence's first block: the salt's, so requests of different salts share no block."""
    if cache_salt is None:
        return ROOT_HASH
    return hashlib.sha256(ROOT_HASH + b"\x00salt\x00" + cache_salt.encode()).digest()


class KVCacheManager:
    """Allocates, shares and frees sequences' KV blocks (``allocate_slots`` / ``fork`` / ``free``).

    Blocks are shared by reference count: full blocks through the prefix cache, and every block of a
    prompt among the ``n`` choices forked from it. A shared block that is not full is copied on write:
    the choice that next writes into it gets a fresh page, and the copy is queued in ``pending_copies``
    for the engine to make before the step's forward pass (the manager never touches tensors).
    """

    def __init__(self, pool: PagePool, enable_prefix_caching: bool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pending_copies: list[tuple[int, int]] = []  # (source page, destination page), in order
        self.num_blocks_allocated = 0  # pages ever handed to sequences, copies included (statistics)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest computed prefix.

        At least one token is always left to compute, so the step that follows yields logits.
        Returns the number of tokens served from the cache.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        max_tokens = seq.num_tokens - 1
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_done:
            # Positions whose prompt logprob is still owed must run: the row at p scores token p + 1.
            max_tokens = min(max_tokens, len(seq.prompt_logprobs) - 1)
        self._extend_hashes(seq, max_tokens // self.block_size)
        for block_hash_ in seq.block_hashes[: max_tokens // self.block_size]:
            page_id = self.pool.lookup(block_hash_)
            if page_id is None:
                break
            self.pool.acquire(page_id)
            seq.block_ids.append(page_id)
        seq.num_registered_blocks = len(seq.block_ids)
        seq.num_computed_tokens = len(seq.block_ids) * self.block_size
        return seq.num_computed_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for the next ``num_new_tokens`` tokens of ``seq``; False if the pool is short.

        A partly filled block that other choices still hold is copied first (copy on write).
        """
        copy_tail = self._is_shared_tail(seq)
        num_missing = self._num_missing_blocks(seq, num_new_tokens)
        if not num_missing and not copy_tail:  # most rows of a step: the next slot is in a block of their own
            return True
        if not self.pool.can_allocate(num_missing + copy_tail):
            return False
        if copy_tail:
            index = seq.num_computed_tokens // self.block_size
            source = seq.block_ids[index]
            [seq.block_ids[index]] = self.pool.allocate(1)
            self.pool.free([source])  # others still hold it
            self.pending_copies.append((source, seq.block_ids[index]))
        if num_missing:
            seq.block_ids.extend(self.pool.allocate(num_missing))
        self.num_blocks_allocated += num_missing + copy_tail
        return True

    def rollback_slots(self, seq: Sequence) -> None:
        """Return the blocks past ``seq``'s computed tokens to the pool (slots of proposed tokens it rejected).

        Their K/V was written but never counted: the next tokens overwrite it, and no such block was
        offered to the prefix cache (only blocks of computed tokens are).
        """
        num_kept = self.num_blocks_for(seq.num_computed_tokens)
        if len(seq.block_ids) > num_kept:
            self.pool.free(seq.block_ids[num_kept:])
            del seq.block_ids[num_kept:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` every block of ``parent`` (one more reference each) and its progress through them."""
        for page_id in parent.block_ids:
            self.pool.acquire(page_id)
        child.block_ids = block_id_array(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies on write queued since the last call, oldest first; the caller makes them."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks that the last step filled to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, num_full)
        for index in range(seq.num_registered_blocks, num_full):
            self.pool.register_block(seq.block_ids[index], seq.block_hashes[index])
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_ids)
        seq.block_ids = block_id_array()
        seq.num_registered_blocks = 0

    def _is_shared_tail(self, seq: Sequence) -> bool:
        """Whether the next token lands in a partly filled block that another sequence holds too."""
        index, offset = divmod(seq.num_computed_tokens, self.block_size)
        return bool(offset) and index < len(seq.block_ids) and self.pool.pages[seq.block_ids[index]].ref_count > 1

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_ids))

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        size = self.block_size
        for index in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq.params.cache_salt)
            tokens = seq.token_ids[index * size : (index + 1) * size]
            digest = seq.adapter.digest_bytes if seq.adapter is not None else b""
            seq.block_hashes.append(block_hash(parent, tokens, digest))

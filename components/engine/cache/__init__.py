"""The target's KV caches as the engines keep them: one request's, and a batch's of many.

* ``slab``   -- ``SlabLayer``/``preallocate``: HF cache layers whose keys/values are views into a
  preallocated buffer, so a round appends in place instead of by ``torch.cat``;
* ``ragged`` -- ``RaggedCache``: one cache for a batch of sequences of different lengths, with a
  mask of the slots that hold committed tokens (holes, left padding, ``compact``, rows that join
  and leave); ``keep_slots``: a batch-1 token tree's accepted path kept in place;
* ``slots``  -- ``SlotPool``/``SlotCache``: a batch's sequences in the rows of one static KV slab
  of the fast target step (each its own row: no holes, no padding, nothing copied);
* ``prefix`` -- ``PrefixStore``: prompt prefixes' keys and values kept in blocks after their
  prefill, copied into a later prompt's slab row where it starts alike (``serve.prefix_cache_tokens``);
* ``views``  -- ``target_kv``: in-place views of any of these (and of the fast step's batch-1
  ``StaticCache``) over the committed context, for a drafter that reads the target's K/V.

Knows HF's cache layer tensors, slot bookkeeping and the ``TargetKV`` record the views are handed
over in; nothing about drafters, rules or requests.
"""

from components.engine.cache.prefix import PrefixStore
from components.engine.cache.ragged import RaggedCache, keep_slots
from components.engine.cache.slab import MIN_HEADROOM, SlabLayer, preallocate
from components.engine.cache.slots import SlotCache, SlotPool, SlotsExhausted
from components.engine.cache.views import target_kv

__all__ = ["MIN_HEADROOM", "PrefixStore", "RaggedCache", "SlabLayer", "SlotCache", "SlotPool", "SlotsExhausted", "keep_slots",
           "preallocate", "target_kv"]

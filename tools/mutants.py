"""The mutation check: plant small defects, one at a time, and run the tests that should catch each.

    python tools/mutants.py            # every mutant; a table of caught / SURVIVED, exit 1 if any survived
    python tools/mutants.py --list     # the mutants and the tests that guard each
    python tools/mutants.py NAME ...   # only these

Not part of CI (it runs the guarding tests once per mutant: ~10-15 minutes on 2 cores). Each mutant
is applied to a copy of the working tree (tracked and untracked files, in a temporary directory);
the copy is what the tests import (``PYTHONPATH`` names it before the editable install, and the
check says so before it starts), so the working tree is never touched, even if the run is killed.
A mutant is *caught* when its tests fail; one whose tests pass *survived*: a test that cannot fail
where it should. Each defect is one the suite claims to guard against (issue 33), or one a past
issue fixed (issue 32), so a survivor is a regression of the suite itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutant:
    name: str
    what: str
    file: str  # relative to the repository
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple  # pytest node ids or paths; -k expressions as ("-k", "...")


MUTANTS = [
    Mutant(
        "host-tier-requantizes",
        "host tier: a copy comes back requantized, not as stored (fp8 rows lose their scales' bits)",
        "treeattn_cli/storage/host_tier.py",
        "shard.fill_layer(layer, t[0], t[1], scales=(t[2], t[3]) if raw else None)",
        "shard.fill_layer(layer, t[0], t[1], scales=None)",
        ("tests/storage/test_host_tier.py",),
    ),
    Mutant(
        "host-tier-unused",
        "host tier: a document the pool gave up is never copied back (always prefilled)",
        "treeattn_cli/engine/documents.py",
        "        hosted = self.host.take(key)  # (resident again",
        "        hosted = None and self.host.take(key)  # (resident again",
        (
            "tests/storage/test_host_tier.py",
            "tests/serving/test_serve.py::test_past_the_waiting_limit_a_request_gets_429_at_once_and_the_others_go_on",
        ),
    ),
    Mutant(
        "evicted-mid-restore-saved",
        "host tier: a document evicted while its restore is under way is saved and kept from its partial blocks",
        "treeattn_cli/engine/documents.py",
        "        if restoring is not None:  # not (all) copied in",
        "        if False:  # not (all) copied in",
        ("tests/storage/test_host_tier.py",),
    ),
    Mutant(
        "census-one-more-op-a-layer",
        "the decode step: one more operation a layer (a copy of the attention's output)",
        "treeattn_cli/engine/attention.py",
        "        return _cascade(ctx, layer, query, key, value, scaling, window, softcap, sink), None",
        "        return _cascade(ctx, layer, query, key, value, scaling, window, softcap, sink).clone(), None",
        ("tests/bench/test_census.py",),
    ),
    Mutant(
        "write-scale-to-nearest",
        "the GPU's fp8 write rounds a group's scale to the nearest bf16, not up (its largest element overflows)",
        "kernels/write_triton.py",
        "(nearest.to(tl.int16, bitcast=True) + up)",
        "(nearest.to(tl.int16, bitcast=True) + up * 0)",
        ("tests/kernel/test_write_kernel.py",),
    ),
    Mutant(
        "write-fp8-unrotated",
        "the GPU's fp8 write stores the rows unrotated",
        "kernels/write_triton.py",
        "r = tl.load(R + dd[:, None] * D + (g * W + cc)[None, :])",
        "r = (dd[:, None] == (g * W + cc)[None, :]).to(tl.float32)",
        ("tests/kernel/test_write_kernel.py",),
    ),
    Mutant(
        "interpreter-truncates",
        "Triton's interpreter narrows fp32 to bf16 by dropping bits, as shipped (not as a GPU rounds)",
        "kernels/targets.py",
        "        if interpreting:\n            round_as_gpus_do()",
        "        if False:\n            round_as_gpus_do()",
        ("tests/kernel/test_write_kernel.py",),
    ),
    Mutant(
        "fixed-rows-stale-buffer",
        "a short chunk of the fixed row policy reads the buffer without its rows copied in",
        "treeattn_cli/model/invariance.py",
        "    buf[: part.shape[0]].copy_(part)\n    return buf",
        "    return buf",
        ("tests/model/test_invariance.py::test_the_check_catches_a_matmul_that_sees_its_batch",),
    ),
    Mutant(
        "rows-in-place-from-the-storage-start",
        "a short chunk taken in place reads its storage's first rows, not the rows after its own start",
        "treeattn_cli/model/invariance.py",
        "    return part.as_strided((chunk, width), (width, 1))",
        "    return part.as_strided((chunk, width), (width, 1), 0)",
        ("tests/model/test_invariance.py::test_rows_made_for_a_linear_layer_are_taken_where_they_lie",),
    ),
    Mutant(
        "attention-output-rows-unpadded",
        "the attention's output is a plain tensor: the fixed row policy copies o_proj's rows again",
        "treeattn_cli/engine/attention.py",
        "    out = invariance.empty_rows((R, T, H, d), q.dtype, q.device, width=H * d)",
        "    out = torch.empty(R, T, H, d, dtype=q.dtype, device=q.device)",
        (
            "tests/kernel/test_triton_end_to_end.py::test_documents_in_the_pool_through_the_paged_kernel_equal_transformers",
        ),
    ),
    Mutant(
        "norm-takes-any-pending-norm",
        "a norm takes the norm the layer before computed whatever tensor it is handed",
        "treeattn_cli/model/fused.py",
        "        if pending is not None and pending[0] is hidden_states:",
        "        if pending is not None:",
        ("tests/model/test_fused.py::test_a_norm_waits_on_its_own_sum_only",),
    ),
    Mutant(
        "next-norm-handed-the-sum",
        "a layer's last add hands the next norm the sum itself where its norm belongs",
        "treeattn_cli/model/fused.py",
        "        nxt.treeattn_pending = (total, normed)",
        "        nxt.treeattn_pending = (total, total)",
        ("tests/model/test_fused.py::test_replaced_modules_keep_the_logits_bits",),
    ),
    Mutant(
        "add-rms-norm-sum-unrounded",
        "the fused add and norm norms the sum before it is rounded to the residual's dtype",
        "kernels/fused_triton.py",
        "    s = (r + x).to(S.dtype.element_ty)",
        "    s = r + x",
        ("tests/kernel/test_fused_kernels.py::test_add_rms_norm_is_the_add_then_the_norm",),
    ),
    Mutant(
        "reduce-pair-split-counts-swapped",
        "the one-launch reduce of two calls reads the first call's splits by the second's count",
        "kernels/merge_triton.py",
        "    oa, la = _reduce_splits(OA, LA, ra, S_a,",
        "    oa, la = _reduce_splits(OA, LA, ra, S_b,",
        ("tests/parallel/test_merge.py::test_two_calls_splits_reduce_and_merge_in_one_launch",),
    ),
    Mutant(
        "partials-slices-overlap",
        "every slice of a long call writes its unreduced splits at the first slice's place",
        "kernels/__init__.py",
        "        at = i * B * H * self.step * S",
        "        at = 0",
        ("tests/parallel/test_merge.py::test_two_calls_splits_reduce_and_merge_in_one_launch",),
    ),
    Mutant(
        "merge-pair-fused-weights-swapped",
        "the GPU's one-launch merge of a step's two partials weighs each with the other's weight",
        "kernels/merge_triton.py",
        "(oa * wa + ob * wb) / tl.where(den > 0, den, 1.0)",
        "(oa * wb + ob * wa) / tl.where(den > 0, den, 1.0)",
        ("tests/parallel/test_merge.py::test_fused_pair_merge_matches_merge_pair",),
    ),
    Mutant(
        "fp8-merged-output-left-rotated",
        "an fp8 pool's step on the GPU's path leaves its merged output in the rotated basis",
        "treeattn_cli/engine/attention.py",
        "        rotation = None if quant is None else quant.rt",
        "        rotation = None",
        ("tests/kernel/test_triton_end_to_end.py",),
    ),
    Mutant(
        "one-rank-merge-writes-nothing",
        "alone (one rank), a step's merged attention is never written into the layer's output",
        "treeattn_cli/engine/attention.py",
        "out=out.transpose(1, 2) if last else None, rotation",
        "out=None, rotation",
        (
            "tests/kernel/test_triton_end_to_end.py::test_documents_in_the_pool_through_the_paged_kernel_equal_transformers",
        ),
    ),
    Mutant(
        "one-document-rows-misread",
        "every row over one document: its partials read back in the wrong order (heads for rows)",
        "treeattn_cli/engine/attention.py",
        "o_d, l_d = o[0].view(H, R, T, d).transpose(0, 1), lse[0].view(H, R, T).transpose(0, 1)",
        "o_d, l_d = o[0].view(R, H, T, d), lse[0].view(R, H, T)",
        (
            "tests/kernel/test_triton_end_to_end.py::test_documents_in_the_pool_through_the_paged_kernel_equal_transformers",
        ),
    ),
    Mutant(
        "prefill-quantizes-apart",
        "on the GPU's branches a prefill's fresh fp8 keys are rounded by torch while the pool's write rounds them in Triton",
        "treeattn_cli/storage/kvquant.py",
        "return quantize(x, self.r, self.dtype, self.groups)",
        'return quantize(x, self.r, self.dtype, self.groups, impl="torch")',
        ("tests/kernel/test_write_kernel.py",),
    ),
    Mutant(
        "interpreter-conversions-seen",
        "the interpreter's float conversions run under the step's dispatch modes (a captured step's replay 'differs')",
        "kernels/interpreted.py",
        "        with _disable_current_modes():  # (the interpreter's own work: no census, no graph capture sees it)",
        "        with threading.Lock():",
        ("tests/kernel/test_interpreted.py",),
    ),
    Mutant(
        "fused-norm-without-eps",
        "the GPU's fused RMS norm leaves eps out",
        "kernels/fused_triton.py",
        "tl.rsqrt(variance + eps)",
        "tl.rsqrt(variance)",
        ("tests/kernel/test_fused_kernels.py",),
    ),
    Mutant(
        "fused-silu-of-the-wrong-sign",
        "the GPU's fused SiLU × up takes exp(g) for exp(-g)",
        "kernels/fused_triton.py",
        "(g / (1.0 + tl.exp(-g)))",
        "(g / (1.0 + tl.exp(g)))",
        ("tests/kernel/test_fused_kernels.py",),
    ),
    Mutant(
        "fused-rope-turned-the-other-way",
        "the GPU's fused rotary embedding rotates each half the other way",
        "kernels/fused_triton.py",
        "sign = tl.where(cols < half, -1.0, 1.0)",
        "sign = tl.where(cols < half, 1.0, -1.0)",
        ("tests/kernel/test_fused_kernels.py",),
    ),
    Mutant(
        "fused-rope-replaced-unchecked",
        "a family's rotary embedding is replaced without checking its formula (GPT-J's interleaved pairs)",
        "treeattn_cli/model/fused.py",
        "    return all(torch.equal(a, b) for a, b in zip(got, want))",
        "    return True",
        ("tests/model/test_fused.py",),
    ),
    Mutant(
        "fused-rope-takes-partial-rotations",
        "the rotary replacement takes a partial rotation's narrower angles (Phi-3's partial_rotary_factor)",
        "treeattn_cli/model/fused.py",
        "if not (q.shape[-1] == k.shape[-1] == cos.shape[-1] == sin.shape[-1]):",
        "if False:",
        ("tests/model/test_fused.py",),
    ),
    Mutant(
        "fused-weights-concatenated-backwards",
        "a layer's q, k and v (gate and up) weights concatenated in the wrong order",
        "treeattn_cli/model/fused_weights.py",
        "torch.cat([p.weight.detach() for p in parts])",
        "torch.cat([p.weight.detach() for p in reversed(parts)])",
        ("tests/model/test_fused.py",),
    ),
    Mutant(
        "fused-mlp-gate-and-up-swapped",
        "the fused MLP puts up through SiLU and multiplies by gate",
        "treeattn_cli/model/fused.py",
        "act_mul(m.gate_proj(x), m.up_proj(x))",
        "act_mul(m.up_proj(x), m.gate_proj(x))",
        ("tests/model/test_fused.py",),
    ),
    Mutant(
        "fused-norm-replaced-unchecked",
        "a module named like an RMS norm is replaced without checking its formula (Gemma's 1 + weight)",
        "treeattn_cli/model/fused.py",
        "            if not same:\n                return False",
        "            if False:\n                return False",
        ("tests/model/test_fused.py",),
    ),
    Mutant(
        "deleted-document-blocks-kept",
        "documents API: a deleted document leaves memory but its blocks are never freed",
        "treeattn_cli/engine/documents.py",
        "            del self.resident[key]\n            doc.cache.free()",
        "            del self.resident[key]\n            doc.cache",
        ("tests/serving/test_soak.py",),
    ),
    Mutant(
        "saved-checksum-unchecked",
        "saved caches: a block's bytes are not checked against their CRC-32",
        "treeattn_cli/storage/kvstore.py",
        "        if want is not None:\n            heads =",
        "        if False:\n            heads =",
        ("tests/storage/test_saved_checks.py",),
    ),
    Mutant(
        "prefix-from-disk-unused",
        "saved caches: a document starting with a saved one's segments never loads them (always prefilled)",
        "treeattn_cli/engine/documents.py",
        "            prefix = copies.find_prefix(self, Path(ref[\"dir\"]), doc, ref)",
        "            prefix = None",
        ("tests/storage/test_saved_checks.py",),
    ),
    Mutant(
        "prefix-one-segment-too-many",
        "saved caches: a prefix loads one segment past where the documents' tokens part",
        "treeattn_cli/storage/copies.py",
        "        if n > max(have, best[1] if best else 0):\n            best = (d.name, n)",
        "        if n > max(have, best[1] if best else 0):\n            best = (d.name, min(n + 1, len(theirs), len(doc.digests)))",
        ("tests/storage/test_saved_checks.py",),
    ),
    Mutant(
        "prefix-judges-foreign-copies",
        "saved caches: a prefix is looked for in another model's copies too (found, refused: removed)",
        "treeattn_cli/storage/copies.py",
        "            if (identity is not None and model != identity) or saved_dtype != dtype:",
        "            if False:",
        ("tests/storage/test_saved_checks.py",),
    ),
    Mutant(
        "saved-checks-first-block-only",
        "saved caches: only a tensor's first block is checked (a flipped byte further on is loaded)",
        "treeattn_cli/storage/kvstore.py",
        "            for i in range(-(-z // R)):",
        "            for i in range(1):",
        ("tests/storage/test_kvstore.py",),
    ),
    Mutant(
        "saved-foreign-loaded",
        "cache directory: a saved copy is loaded without checking whose it is",
        "treeattn_cli/storage/copies.py",
        "        if identity is None:  # (nothing to check it against: a test's directory)",
        "        if True:  # (nothing to check it against: a test's directory)",
        ("tests/storage/test_saved_checks.py",),
    ),
    Mutant(
        "serve-no-recovery",
        "serve: a lost rank is never replaced (the server answers 503 until a person acts)",
        "treeattn_cli/serving/supervision.py",
        "if reason is not None and not self.recover(reason):",
        "if reason is not None and False:",
        (
            "tests/serving/test_serve.py::test_sigterm_then_a_restart_keeps_the_documents_and_lost_ranks_come_back",
            "tests/serving/test_soak.py",
        ),
    ),
    Mutant(
        "serve-batch-loss-silent",
        "serve: requests of the running batch are not ended when the ranks are lost (their streams hang)",
        "treeattn_cli/serving/front.py",
        "                    self.stats.ended(\"error\")\n                    t.deliver(Failed(reason))",
        "                    pass",
        ("tests/serving/test_serve.py::test_sigterm_then_a_restart_keeps_the_documents_and_lost_ranks_come_back",),
    ),
    Mutant(
        "serve-cancel-ignored",
        "serve: EngineFront.cancel does nothing (a client that leaves keeps its slot)",
        "treeattn_cli/serving/front.py",
        "    def cancel(self, t: Ticket) -> None:\n        t.cancelled.set()",
        "    def cancel(self, t: Ticket) -> None:\n        return",
        ("tests/serving/test_serve.py::test_a_client_that_leaves_cancels_its_request",),
    ),
    Mutant(
        "engine-cancel-ignored",
        "batch: a cancelled question runs on to its end",
        "treeattn_cli/engine/batch.py",
        "if reason is None and s.question in gone:",
        "if reason is None and False:",
        ("tests/serving/test_serve.py::test_a_client_that_leaves_cancels_its_request",),
    ),
    Mutant(
        "batch-drafts-nothing",
        "batch: slots never draft (speculation silently off in chat --batch and serve)",
        "treeattn_cli/engine/batch.py",
        "nxt = s.drafter.draft(min(s.speculation.want(len(ready_b)), q.max_new_tokens - len(s.tokens) - 1, KMAX))",
        "nxt = []",
        (
            "tests/engine/test_speculate.py::test_batched_slots_draft_and_accept_on_their_own",
            "tests/storage/test_kvquant.py::test_fp8_cache_is_exact_to_its_rounding_on_every_route",
        ),
    ),
    Mutant(
        "merge-weight-allreduce",
        "merge: rank 1's partial enters the all-reduce merge without its weight",
        "treeattn_cli/parallel/comm.py",
        'packed = self.sum_in_rank_order(weigh(o, lse, m))  # [..., d + 1] = [Σ o·w, Σ w]',
        'packed = self.sum_in_rank_order(weigh(o, lse, m) if self.rank != 1 else '
        'torch.cat([o.float(), torch.ones_like(lse.float())[..., None]], -1))',
        ("tests/parallel/test_comm.py::test_every_scheme_and_ring_decode_equal_one_rank",),
    ),
    Mutant(
        "merge-weight-tree",
        "merge: the partial a rank receives in the tree merge is taken unweighted",
        "treeattn_cli/parallel/merge.py",
        "o = (o_a.float() * w_a[..., None] + o_b.float() * w_b[..., None]) / _nonzero(den)[..., None]",
        "o = (o_a.float() * w_a[..., None] + o_b.float()) / _nonzero(den)[..., None]",
        (
            "tests/parallel/test_merge.py",
            "tests/parallel/test_comm.py::test_every_scheme_and_ring_decode_equal_one_rank",
        ),
    ),
    Mutant(
        "batch-no-rollback",
        "batch: a slot's rejected drafts stay in its tail",
        "treeattn_cli/engine/batch.py",
        "                self.bd.tail.truncate_extension(b, keep=n_out)",
        "                pass",
        ("tests/engine/test_speculate.py::test_batched_slots_draft_and_accept_on_their_own",),
    ),
    Mutant(
        "stop-ignored",
        "engine: stop strings never end an answer",
        "treeattn_cli/engine/engine.py",
        "            if any(s in tail for s in stop):",
        "            if False:",
        (
            "tests/cli/test_generate.py::test_stop_string_and_output_file",
            "tests/engine/test_batch.py::test_chat_batch_equals_one_at_a_time",
        ),
    ),
    Mutant(
        "tail-of-another-slot",
        "tail: a batch's rows read the first row's tail",
        "treeattn_cli/engine/paged_tail.py",
        "        return t[torch.as_tensor(list(rows), dtype=torch.int64, device=self.device), :width]",
        "        return t[torch.as_tensor([list(rows)[0]] * len(rows), dtype=torch.int64, device=self.device), :width]",
        ("tests/engine/test_batch.py::test_batched_answers_equal_each_question_alone",),
    ),
    Mutant(
        "probe-window-paged-documents",
        "pooled documents on the GPU's branch: the window one key wider",
        "treeattn_cli/engine/attention.py",
        "    kw = dict(q_pos=qp, pos_pool=pool.pos, window=window) if window is not None else {}",
        "    kw = dict(q_pos=qp, pos_pool=pool.pos, window=window + 1) if window is not None else {}",
        ("tests/verify/test_families.py::test_probe_passes_every_family_and_refuses_a_dropped_sink",),
    ),
    Mutant(
        "probe-softcap-paged-tail",
        "a pooled tail on the GPU's branch: its logits not soft-capped",
        "treeattn_cli/engine/attention.py",
        "        pool, layer, q, tables, kv_len, rotated, partials, scale=scale, softcap=softcap, **_tail_kernel(q), **kw",
        "        pool, layer, q, tables, kv_len, rotated, partials, scale=scale, softcap=None, **_tail_kernel(q), **kw",
        ("tests/verify/test_families.py::test_probe_passes_every_family_and_refuses_a_dropped_sink",),
    ),
    Mutant(
        "probe-sink-cascade",
        "a batch's step (the cascade over pooled documents): the sinks left out",
        "treeattn_cli/engine/attention.py",
        "    if sink is not None and comm.rank == 0:  # the same queries on every rank: the sink joins once\n"
        "        o, lse = add_sink(o, lse, sink)\n    if not last:",
        "    if False:\n        o, lse = add_sink(o, lse, sink)\n    if not last:",
        ("tests/verify/test_families.py::test_probe_passes_every_family_and_refuses_a_dropped_sink",),
    ),
    Mutant(
        "probe-positions-paged-tail",
        "a pooled tail on the GPU's branch: its rows' positions one ahead",
        "treeattn_cli/engine/attention.py",
        "    kw = dict(q_pos=pos, pos_pool=pool.pos, window=window) if (q.shape[2] > 1 or window is not None) else {}",
        "    kw = dict(q_pos=pos + 1, pos_pool=pool.pos, window=window) if (q.shape[2] > 1 or window is not None) "
        "else {}",
        ("tests/verify/test_families.py::test_probe_passes_every_family_and_refuses_a_dropped_sink",),
    ),
    Mutant(
        "window-bound-reference",
        "reference kernel: the sliding window's bound is not applied",
        "kernels/partial_ref.py",
        "            causal = causal & (diff < window)",
        "            causal = causal",
        (
            "tests/kernel/test_partial_attention.py",
            "tests/verify/test_families.py::test_every_family_equals_transformers",
        ),
    ),
    Mutant(
        "window-bound-triton",
        "Triton kernel: the sliding window's bound is not applied",
        "kernels/partial_triton.py",
        "            vis = vis & (diff < window)",
        "            vis = vis",
        ("tests/kernel/test_partial_attention.py", "tests/kernel/test_triton_end_to_end.py"),
    ),
    Mutant(
        "extend-resets-every-row",
        "tail: begin_extend forgets every row's extension (issue 32's defect)",
        "treeattn_cli/engine/paged_tail.py",
        '            raise RuntimeError("begin_extend: the previous extension was not ended (end_extend)")\n',
        '            raise RuntimeError("begin_extend: the previous extension was not ended (end_extend)")\n'
        "        self._ext_owners = [None] * self.batch\n",
        (
            "tests/engine/test_tail.py",
            "tests/engine/test_batch.py::test_chat_batch_with_drafts_refilling_slots_equals_one_at_a_time",
        ),
    ),
    Mutant(
        "batch-graph-stale-inputs",
        "batch: a replayed step reads the capturing step's inputs, not its own copies",
        "treeattn_cli/engine/runner.py",
        "logits = graphs.run(key, inputs, lambda *t: forward(*t, eager=False), lambda: forward(*inputs))",
        "logits = graphs.run(key, inputs, lambda *t: forward(*inputs, eager=False), lambda: forward(*inputs))",
        ("tests/engine/test_batch.py::test_captured_batched_steps_replay_what_they_captured_and_answer_as_alone",),
    ),
    Mutant(
        "batch-decoder-per-batch",
        "engine: every batch makes its decoder, tail and graphs afresh (captured again)",
        "treeattn_cli/engine/engine.py",
        "        if bd is None or bd.slots != slots:",
        "        if True:",
        ("tests/engine/test_batch.py::test_captured_batched_steps_replay_what_they_captured_and_answer_as_alone",),
    ),
    Mutant(
        "pooled-shard-copied",
        "paged_shard: a shard of consecutive blocks is gathered (copied) at every read",
        "treeattn_cli/engine/paged_shard.py",
        "        run = bool(used) and used == list(range(used[0], used[0] + len(used)))",
        "        run = False",
        ("tests/engine/test_pool.py::test_a_shard_of_consecutive_blocks_is_read_in_place",),
    ),
    Mutant(
        "conversation-pending-lost",
        "documents: a kept answer's last token is never fed (the next turn skips it)",
        "treeattn_cli/engine/documents.py",
        "        doc.pending = tokens[n] if len(tokens) == n + 1 and upto is None else None",
        "        doc.pending = None",
        ("tests/engine/test_pooled_conversation.py",),
    ),
    Mutant(
        "conversation-fold-ignores-room",
        "documents: a kept turn is folded in without asking the pool for room",
        "treeattn_cli/engine/documents.py",
        "        if not self.room(doc, m):",
        "        if False:",
        ("tests/engine/test_pooled_conversation.py",),
    ),
    Mutant(
        "chat-reset-keeps-turns",
        "chat: /reset in a pooled --conversation leaves the kept turns in the document",
        "treeattn_cli/cli/chat.py",
        "            if o.conversation:  # (else every question starts from the document anyway)",
        "            if False:",
        ("tests/cli/test_chat.py::test_reset_in_a_conversation_returns_to_the_document",),
    ),
    Mutant(
        "tail-placement-ignores-document",
        "tail: a batch slot's tokens are placed as if its document held nothing",
        "treeattn_cli/engine/paged_tail.py",
        "        owner = torch.argmin(self.counts + self.beside, dim=1)  # first minimum = lowest rank",
        "        owner = torch.argmin(self.counts, dim=1)",
        ("tests/cli/test_generate.py::test_greedy_token_ids_equal_transformers",),
    ),
    Mutant(
        "question-placement-ignores-document",
        "tail: a batch slot's question is placed as if its document held nothing",
        "treeattn_cli/engine/paged_tail.py",
        "            total = self.counts[b] + self.beside[b]\n"
        "            owners = self._ext_owners[b] = fewest_first(total, len(real))  # this sequence's new tokens' owners\n"
        "            self.counts[b] = total - self.beside[b]",
        "            total = self.counts[b].clone()\n"
        "            owners = self._ext_owners[b] = fewest_first(total, len(real))  # this sequence's new tokens' owners\n"
        "            self.counts[b] = total",
        ("tests/engine/test_pooled_conversation.py",),
    ),
    Mutant(
        "generate-saves-only-the-loaded-document",
        "generate --load-kv --save-kv: the prompt is not kept into the saved cache",
        "treeattn_cli/engine/engine.py",
        '        keep = {"keep": "question"} if job.load_kv and job.save_kv else {}',
        '        keep = {}',
        ("tests/cli/test_generate.py::test_a_loaded_cache_continued_and_saved_again_holds_the_prompt_too",),
    ),
    Mutant(
        "verify-kept-miscounted",
        "tail: a captured verify counts a row's keys without its new ones",
        "treeattn_cli/engine/paged_tail.py",
        "        return (self.host_length + self._ext_added).tolist()",
        "        return self.host_length.tolist()",
        (
            "tests/engine/test_speculate.py::test_captured_batched_verifies_keep_each_questions_tokens",
            "tests/engine/test_speculate.py::test_captured_verifies_replay_and_keep_the_greedy_tokens",
        ),
    ),
    Mutant(
        "drafts-depend-on-the-cut",
        "drafter: n-grams stop at the base/own boundary (issue 32's drafter defect)",
        "treeattn_cli/engine/speculate.py",
        "        return (self.base.tokens[i : i + k] + self.tokens[: max(0, i + k - lb)])[:k]",
        "        return self.base.tokens[i : i + k]",
        ("tests/engine/test_speculate.py::test_drafts_do_not_depend_on_where_the_sequence_is_cut_into_base_and_own",),
    ),
    Mutant(
        "idle-slot-at-zero",
        "batch: idle slots step at position 0 (a window layer reads the whole shard)",
        "treeattn_cli/engine/batch.py",
        "[at.get(b, at[live]) for b in range(S)],",
        "[at.get(b, 0) for b in range(S)],",
        ("tests/engine/test_batch.py::test_idle_slots_step_at_a_live_position",),
    ),
    Mutant(
        "cite-local-lse",
        "--cite: a key's share is taken against its rank's own lse, not the merged one",
        "treeattn_cli/engine/attention.py",
        "    _, lse = comm.merge(o, lse, out=out.transpose(1, 2), eager=ctx.eager)  # a batch's step may be captured",
        "    comm.merge(o, lse, out=out.transpose(1, 2), eager=ctx.eager)",
        ("tests/engine/test_cite.py::test_citation_masses_are_transformers_attention",),
    ),
    Mutant(
        "cite-rejected-drafts-count",
        "--cite: the rows of rejected drafts count in the citations",
        "treeattn_cli/engine/batch.py",
        "                s.citation.keep(n_out)",
        "                s.citation.keep(1 + len(self.drafts[b]))",
        ("tests/engine/test_cite.py::test_citation_masses_are_transformers_attention",),
    ),
    Mutant(
        "cite-rows-of-the-wrong-slot",
        "--cite: a batch step's citing rows are taken one slot off",
        "treeattn_cli/engine/runner.py",
        "            cites=[s.citation if going[b] else None for b, s in enumerate(of)],",
        "            cites=[of[(b + 1) % len(of)].citation if going[b] else None for b, s in enumerate(of)],",
        ("tests/engine/test_cite.py::test_citation_masses_are_transformers_attention",),
    ),
    Mutant(
        "batch-keeps-two-per-document",
        "a batch keeps two questions over one document (both fed its pending token)",
        "treeattn_cli/engine/engine.py",
        '            if doc.key in kept_docs:',
        "            if False:",
        ("tests/engine/test_pooled_conversation.py::test_a_batch_keeps_at_most_one_question_per_document",),
    ),
    Mutant(
        "softcap-compiled-out",
        "Triton 3.5/3.6's static soft-capping: compiled out for a soft-capped model",
        "kernels/partial_triton.py",
        "    return 1 if softcap else -1",
        "    return -1",
        ("tests/kernel/test_partial_attention.py::test_softcap_compiled_in_or_out",),
    ),
    Mutant(
        "softcap-static-uncapped",
        "Triton 3.5/3.6's kernel with soft-capping compiled in does not cap",
        "kernels/partial_triton.py",
        "    elif SOFTCAP > 0:\n        s = _capped(s, qk_scale, softcap)",
        "    elif SOFTCAP > 0:\n        s = s * qk_scale",
        ("tests/kernel/test_partial_attention.py::test_softcap_compiled_in_or_out",),
    ),
    Mutant(
        "short-document-unwritten",
        "a document shorter than the shards: its pooled tokens' keys and values never written",
        "treeattn_cli/engine/paged_shard.py",
        "        if t.numel():\n            self.pool.write(layer, slots,",
        "        if False:\n            self.pool.write(layer, slots,",
        ("tests/engine/test_batch.py::test_every_document_lives_in_the_pool_short_ones_and_saved_ones_that_wait",),
    ),
    Mutant(
        "tail-blocks-kept",
        "batch: an answer that ends keeps its tail's blocks (the pool fills with finished answers)",
        "treeattn_cli/engine/batch.py",
        "            tail.release(s.row)",
        "            pass",
        ("tests/engine/test_batch.py::test_questions_wait_for_their_tails_blocks_and_give_them_back",),
    ),
    Mutant(
        "tail-admitted-without-blocks",
        "batch: a question takes a slot without its tail's blocks",
        "treeattn_cli/engine/batch.py",
        "            tail.admit(b, need * tail.pool.page)\n            return True",
        "            return True",
        ("tests/engine/test_batch.py::test_questions_wait_for_their_tails_blocks_and_give_them_back",),
    ),
    Mutant(
        "saved-load-never-makes-room",
        "a saved document's load waits for free blocks but never evicts an unused document",
        "treeattn_cli/engine/documents.py",
        "            if not copies.load(self, doc):",
        "            if not copies.load(self, doc, evict=False):",
        ("tests/engine/test_batch.py::test_every_document_lives_in_the_pool_short_ones_and_saved_ones_that_wait",),
    ),
    Mutant(
        "admission-ignores-tail",
        "serve's admission counts a request's document but not its question and answer",
        "treeattn_cli/engine/room.py",
        "        tail = tail_blocks(tail_tokens, self.cp, self.page) if tail_tokens else 0",
        "        tail = 0",
        (
            "tests/serving/test_serve.py::test_a_request_and_a_pin_are_counted_in_the_pools_blocks_beside_the_pinned_documents",
        ),
    ),
    Mutant(
        "tail-positions-unplaced",
        "a pooled tail's question tokens keep no position in the pool (the paged read masks nothing among them)",
        "treeattn_cli/engine/paged_tail.py",
        "        if b_idx:\n            self._place(self._ext[0], self._ext[3])",
        "        pass",
        ("tests/engine/test_paged_tail.py",),
    ),
    Mutant(
        "tail-gathered-on-gpu",
        "on the GPU's path a pooled tail is still gathered into dense views every layer",
        "treeattn_cli/engine/attention.py",
        'tail_paged = gpu_path(q) and getattr(tail, "pool", None) is not None',
        "tail_paged = False",
        (
            "tests/kernel/test_triton_end_to_end.py::test_documents_in_the_pool_through_the_paged_kernel_equal_transformers",
        ),
    ),
    Mutant(
        "chat-pool-without-context-room",
        "chat sizes its pool for --batch short questions only: a long one is left unanswered",
        "treeattn_cli/cli/chat.py",
        'return doc, {"pool_for": n, **tails, "grow": True, **kept}',
        'return doc, {"pool_for": n, **tails, **({"grow": True} if o.conversation else {}), **kept}',
        ("tests/cli/test_chat.py::test_a_question_longer_than_the_pools_room_per_slot_is_answered",),
    ),
    Mutant(
        "chat-refusal-exits-0",
        "chat refuses a question with an error line but exits 0 (a script never knows)",
        "treeattn_cli/cli/chat.py",
        "    return 2 if code == 0 and _REFUSED else code",
        "    return code",
        ("tests/cli/test_chat.py", "-k", "refused_question"),
    ),
    Mutant(
        "tail-on-the-fused-kernel",
        "a CPU batch's tail rows go to ATen's fused kernel, whose sums follow the tail's width",
        "treeattn_cli/engine/attention.py",
        'return dict(impl=shared_impl(q) if gpu_path(q) else "torch", fixed_splits=True)',
        'return dict(impl=shared_impl(q) if gpu_path(q) else "auto", fixed_splits=True)',
        ("tests/model/test_invariance.py::test_answers_on_the_embedded_model_with_fp8_are_the_ones_alone",),
    ),
    Mutant(
        "sum-over-ranks-by-segment",
        "the merge sums 3+ ranks' partials with a SUM all-reduce (its order follows the batch)",
        "treeattn_cli/parallel/comm.py",
        "        if self.world <= 2:\n            return self.all_reduce(t, \"sum\")",
        "        if True:\n            return self.all_reduce(t, \"sum\")",
        ("tests/model/test_invariance.py::test_sums_over_three_ranks_do_not_see_the_batch",),
    ),
    Mutant(
        "mkl-not-strict",
        "the ranks' MKL without strict reproducibility (a row's GEMM then follows its batch)",
        "treeattn_cli/__init__.py",
        'os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")',
        'os.environ.setdefault("MKL_CBWR", "COMPATIBLE")',
        ("tests/model/test_invariance.py::test_a_cpu_model_in_fp32_keeps_its_rows_through_the_library",),
    ),
    Mutant(
        "reference-one-row-matmul",
        "the reference multiplies a lone row by itself (a one-row batched matmul takes another kernel)",
        "kernels/partial_ref.py",
        "    Rp = max(R, 2)  #",
        "    Rp = max(R, 1)  #",
        ("tests/model/test_invariance.py::test_reference_rows_keep_their_bits_beside_other_rows_and_later_keys",),
    ),
    Mutant(
        "triton-tile-by-rows",
        "the split kernel's tile follows the query rows again (a decode row and a verify's differ)",
        "kernels/partial_triton.py",
        "    block_m = tile_rows(G)\n",
        "    block_m = max(16, triton.next_power_of_2(G * Q))\n",
        (
            "tests/kernel/test_partial_attention.py::test_the_plan_does_not_depend_on_the_batch_or_the_rows",
            "tests/model/test_invariance.py::test_triton_rows_keep_their_bits_beside_other_rows_and_later_keys",
        ),
    ),
    Mutant(
        "tp-rows-strided",
        "a tensor-parallel layer takes the LM head's strided rows as they come",
        "treeattn_cli/model/invariance.py",
        "            return forward(x.contiguous(), *args, **kwargs)",
        "            return forward(x, *args, **kwargs)",
        ("tests/test_combinations.py",),
    ),
]


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = ROOT / f.decode()
        if src.is_file():
            (dst / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f.decode())


def _env(copy: Path, shadow: Path) -> dict:
    """The copy's packages first on the path (the installed names: ``kernels/`` is
    ``treeattn_kernels``), before the editable install that points at the working tree."""
    shadow.mkdir(exist_ok=True)
    for name, target in (("treeattn_cli", copy / "treeattn_cli"), ("treeattn_kernels", copy / "kernels")):
        if not (shadow / name).exists():
            (shadow / name).symlink_to(target, target_is_directory=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import treeattn_cli, treeattn_kernels; print(treeattn_cli.__file__); print(treeattn_kernels.__file__)",
        ],
        env=env,
        cwd=copy,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not all(p.startswith(str(shadow.parent)) for p in probe):
        raise SystemExit(f"mutants: the copy is not what Python imports ({probe}); refusing to run")
    return env


def _run(m: Mutant, copy: Path, env: dict, timeout: float) -> tuple[str, float, str]:
    f = copy / m.file
    orig = f.read_text()
    if orig.count(m.old) != 1:
        return "STALE", 0.0, f"the text to mutate occurs {orig.count(m.old)} times in {m.file}: update the mutant"
    f.write_text(orig.replace(m.old, m.new))
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        rc, tail = r.returncode, (r.stdout + r.stderr).strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        rc, tail = -1, [f"no verdict within {timeout:.0f} s"]
    finally:
        f.write_text(orig)
    verdict = {0: "SURVIVED", 1: "caught"}.get(rc, "ERROR")  # 2-5: interrupted, usage, collection
    return verdict, time.monotonic() - t0, (tail[0] if tail else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and their tests")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant (default 900)")
    ap.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the first run of the guarding tests on the unmutated copy (they must pass)",
    )
    a = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not a.names or m.name in a.names]
    unknown = set(a.names) - {m.name for m in MUTANTS}
    if unknown:
        print(f"mutants: unknown {sorted(unknown)}; --list names them", file=sys.stderr)
        return 2
    if a.list:
        for m in chosen:
            print(f"{m.name:26} {m.what}\n{'':26} guarded by: {' '.join(m.tests)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="treeattn-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        _copy_tree(copy)
        env = _env(copy, Path(tmp) / "shadow")
        if not a.no_baseline:  # a failure on the unmutated tree would read as a caught mutant
            # the guarding tests together, but those with a -k expression apart (their -k would
            # select among everyone's tests: a baseline of 2 tests where 57 were meant, 2026-11-28)
            plain = list(dict.fromkeys(t for m in chosen if "-k" not in m.tests for t in m.tests))
            runs = ([plain] if plain else []) + [
                list(t) for t in dict.fromkeys(m.tests for m in chosen if "-k" in m.tests)
            ]
            for tests in runs:
                t0 = time.monotonic()
                r = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                    cwd=copy,
                    env=env,
                    capture_output=True,
                    text=True,
                )
                last = (r.stdout + r.stderr).strip().splitlines()[-1:]
                print(
                    f"{'(baseline)':26} {'pass' if r.returncode == 0 else 'FAIL':9} {time.monotonic() - t0:7.0f}  "
                    f"{last[0] if last else ''}",
                    flush=True,
                )
                if r.returncode != 0:
                    print("mutants: the guarding tests fail without a mutant; fix that first", file=sys.stderr)
                    return 2
        rows = []
        print(f"{'mutant':26} {'verdict':9} {'seconds':>7}  last line of pytest", flush=True)
        for m in chosen:
            verdict, secs, tail = _run(m, copy, env, a.timeout)
            rows.append((m, verdict))
            print(f"{m.name:26} {verdict:9} {secs:7.0f}  {tail}", flush=True)
    bad = [m.name for m, v in rows if v != "caught"]
    print(
        f"\n{len(rows) - len(bad)} of {len(rows)} planted defects caught"
        + (f"; not caught: {', '.join(bad)}" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

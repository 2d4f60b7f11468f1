#!/usr/bin/env python3
"""Break each SSD-tier guarantee on purpose, one at a time, and check that a test fails (a test that cannot fail
proves nothing). Each mutation replaces one exact snippet of a source file, runs the named tests in the clone's
.venv, prints CAUGHT or MISSED (STALE when its snippet no longer matches, BROKEN when the tests could not run: failures
too), and restores the file.
Usage: scripts/mutation-check.py [NAME-SUBSTRING ...]"""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTS = [  # (name, file, exact snippet, its replacement, tests that must fail)
    (
        'journal fsync removed',
        'storage_backends/ssd/slot_io.py',
        'self.journal.append(records, sync=self.durable)',
        'self.journal.append(records, sync=False)',
        'tests/test_ssd_durability.py',
    ),
    (
        'data fdatasync removed',
        'storage_backends/ssd/slot_io.py',
        '                    self.files.sync(fd)\n',
        '                    pass\n',
        'tests/test_ssd_durability.py',
    ),
    (
        'bad-CRC journal record accepted',
        'storage_backends/ssd/slot_format.py',
        '                if crc32(payload) == crc:',
        '                if True:',
        'tests/test_ssd_faults.py tests/test_ssd_fuzz.py',
    ),
    (
        'indexed after failed journal append',
        'storage_backends/ssd/tier_writes.py',
        '                    reasons = ["io_error" if why is None else why for why in reasons]',
        '                    pass',
        'tests/test_ssd_faults.py',
    ),
    (
        'dup check only before waiting (defect 1)',
        'storage_backends/ssd/write_queue.py',
        (
            '        while True:\n'
            '            if self.closed:\n'
            '                return Submitted.CLOSED\n'
            '            if task.key in self._pending or self._is_stored(task.key):\n'
            '                return Submitted.DUPLICATE\n'
        ),
        (
            '        if task.key in self._pending or self._is_stored(task.key):\n'
            '            return Submitted.DUPLICATE\n'
            '        while True:\n'
            '            if self.closed:\n'
            '                return Submitted.CLOSED\n'
        ),
        'tests/test_ssd_faults.py::test_same_key_from_two_threads_under_backpressure_is_stored_once',
    ),
    (
        'double commit leaks old slot',
        'storage_backends/ssd/index.py',
        (
            '            if old is not None:\n'
            '                self._drop(key, old, None)\n'
            '            self._entries[key] = Entry'
        ),
        '            self._entries[key] = Entry',
        'tests/test_ssd_faults.py::test_a_key_committed_twice_frees_the_older_slot',
    ),
    (
        'journal stops at first bad record (defect 2)',
        'storage_backends/ssd/slot_format.py',
        (
            '        nxt = next((p for p in range(pos + 1, n - _REC_FRAME.size + 1) if _record_at(data, p) is not'
            ' None), None)'
        ),
        '        nxt = None',
        'tests/test_ssd_faults.py tests/test_ssd_fuzz.py',
    ),
    (
        'records not range-checked (defect 3)',
        'storage_backends/ssd/slot_format.py',
        (
            'Slot = Annotated[int, msgspec.Meta(ge=0)]\n'
            'Gen = Annotated[int, msgspec.Meta(ge=1, lt=MAX_GENERATION)]\n'
            'Size = Annotated[int, msgspec.Meta(ge=0)]\n'
            'Dim = Annotated[int, msgspec.Meta(ge=0)]\n'
            'Name = Annotated[str, msgspec.Meta(min_length=1)]\n'
            'Seg = Annotated[int, msgspec.Meta(gt=0, le=MAX_SEGMENT_BYTES, multiple_of=_SEG_ALIGN)]'
        ),
        (
            'Slot = Gen = Size = Dim = Seg = int\n'
            'Name = str'
        ),
        'tests/test_ssd_faults.py tests/test_ssd_fuzz.py',
    ),
    (
        'links followed (defect 4)',
        'storage_backends/ssd/posix_io.py',
        '    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)',
        '    return os.open(path, flags | os.O_CLOEXEC, mode)',
        'tests/test_ssd_faults.py',
    ),
    (
        'world-writable dir kept (defect 4)',
        'storage_backends/ssd/directory.py',
        '    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):',
        '    if False:',
        'tests/test_ssd_faults.py',
    ),
    (
        'FREE append raises (defect 5)',
        'storage_backends/ssd/slot_io.py',
        (
            '        except OSError as e:\n'
            '            self.episodes.occurred("journal-free"'
        ),
        (
            '        except ValueError as e:\n'
            '            self.episodes.occurred("journal-free"'
        ),
        'tests/test_ssd_faults.py',
    ),
    (
        'disk-full never retried (defect 5)',
        'storage_backends/ssd/tier_writes.py',
        '            idx.restore_limit()\n',
        '            pass\n',
        'tests/test_ssd_faults.py',
    ),
    (
        'one bad chunk fails its batch (defect 6)',
        'storage_backends/ssd/slot_io.py',
        (
            '                out[i] = "too_large"\n'
            '                continue'
        ),
        '                raise',
        'tests/test_ssd_faults.py',
    ),
    (
        'device read leaks reader (defect 7)',
        'storage_backends/ssd/tier_reads.py',
        (
            '        finally:\n'
            '            self.index.end_read(keys, entries, verdicts, served)\n'
            '            self._reading(-1)\n'
            '        M.SSD_READ_SECONDS.observe(time.monotonic() - t0)\n'
            '        return served'
        ),
        (
            '        except Exception:\n'
            '            self._reading(-1)\n'
            '            raise\n'
            '        if all(v is None for v in verdicts):\n'
            '            self.index.end_read(keys, entries, verdicts, served)\n'
            '        self._reading(-1)\n'
            '        M.SSD_READ_SECONDS.observe(time.monotonic() - t0)\n'
            '        return served'
        ),
        'tests/test_ssd_faults.py',
    ),
    (
        'key check removed',
        'storage_backends/ssd/slot_io.py',
        '        if h.key != it.key:',
        '        if False:',
        'tests/test_ssd_faults.py tests/test_ssd_fuzz.py',
    ),
    (
        'RPC stops at first error (defect 8)',
        'connector/rpc.py',
        (
            '            if isinstance(rep, Failed):\n'
            '                errors.append'
        ),
        (
            '            if isinstance(rep, Failed):\n'
            '                raise RPCError(rep.error)\n'
            '                errors.append'
        ),
        'tests/test_connector_config.py',
    ),
    (
        'chunk_format unchecked (defect 9)',
        'storage_backends/config.py',
        (
            '    if "chunk_format" in values:\n'
            '        _check_chunk_format'
        ),
        (
            '    if False:\n'
            '        _check_chunk_format'
        ),
        'tests/test_lmcache_plugin.py::test_unknown_key_fails_plugin_construction_loudly_in_check_config',
    ),
    (
        'stale records win',
        'storage_backends/ssd/index.py',
        (
            '                    if (old is not None and entries[old].gen >= rec.gen) or (prev is not None and pr'
            'ev.gen >= rec.gen):'
        ),
        '                    if False:',
        'tests/test_ssd_fuzz.py',
    ),
    (
        'compaction beside commits unlocked',
        'storage_backends/ssd/tier_writes.py',
        (
            '            with self._commit_lock:\n'
            '                if self.io.records_written >'
        ),
        (
            '            if True:\n'
            '                if self.io.records_written >'
        ),
        'tests/test_ssd_durability.py::test_journal_compaction_never_drops_a_commit_on_its_way_to_the_index',
    ),
    (
        'no pin release check (concurrency)',
        'storage_backends/ssd/index.py',
        (
            '            e.pins.pop(0)\n'
            '            return True'
        ),
        '            return True',
        'tests/test_ssd_concurrency.py',
    ),
    (
        'untrusted generation replayed (issue 28, 2)',
        'storage_backends/ssd/index.py',
        'if rec.gen >= TRUSTED_GENERATION or (',
        'if (',
        'tests/test_ssd_reliability.py::test_record_with_an_exhausting_generation_is_skipped_and_stores_go_on',
    ),
    (
        'key not checked for UTF-8 (issue 28, 3)',
        'storage_backends/ssd/tier_writes.py',
        '        key.encode("utf-8")\n    except UnicodeEncodeError as e:\n        return f"invalid key',
        '        pass\n    except UnicodeEncodeError as e:\n        return f"invalid key',
        'tests/test_ssd_reliability.py::test_lone_surrogate_key_is_a_counted_drop_not_an_exception',
    ),
    (
        'back-pressure episode never cleared (issue 28, 4)',
        'storage_backends/ssd/tier_writes.py',
        'self.io.episodes.cleared("backpressure",',
        'str(',
        'tests/test_ssd_reliability.py::test_backpressure_episodes_are_logged_each_time',
    ),
    (
        'pinned-slot drops not logged (issue 28, 4)',
        'storage_backends/ssd/tier_writes.py',
        '            self._log_blocked(batch, reservations)\n',
        '',
        'tests/test_ssd_reliability.py::test_drops_because_every_slot_is_pinned_are_logged_once_and_cleared',
    ),
    (
        'remove() does not cancel a queued write (issue 28, 5)',
        'storage_backends/ssd/tier.py',
        'cancelled = self.queue.cancel(key)',
        'cancelled = False',
        'tests/test_ssd_reliability.py::test_remove_cancels_a_queued_write',
    ),
    (
        'cancelled write committed anyway (issue 28, 5)',
        'storage_backends/ssd/tier_writes.py',
        '                            if t.cancelled:\n                                continue\n',
        '',
        'tests/test_ssd_reliability.py::test_remove_racing_the_writer_never_leaves_a_removed_chunk',
    ),
    (
        'eviction final before the journal append (issue 28, 6)',
        'storage_backends/ssd/tier_writes.py',
        '            if not self._journal_victims(reservations):',
        '            if self.index.settle_victims(reservations, journaled=False):',
        'tests/test_ssd_reliability.py::test_failed_journal_append_costs_no_committed_chunk',
    ),
    (
        'failed fallocate not cut back (issue 28, 1)',
        'storage_backends/ssd/slot_files.py',
        '        except OSError:\n            self._cut(fd, have)\n            raise\n',
        '        except OSError:\n            raise\n',
        'tests/test_ssd_disk_full.py',
    ),
    (
        'slot growth takes the journal reserve (issue 28, 1)',
        'storage_backends/ssd/slot_files.py',
        '        want = min(want, have + self._room(want - have, pos + 1 - have))\n',
        '',
        'tests/test_ssd_disk_full.py',
    ),
    (
        'lock note needs a free block (issue 28, 1)',
        'storage_backends/ssd/directory.py',
        '        os.pwrite(fd, note, 0)\n        os.ftruncate(fd, len(note))\n    except OSError as e:\n'
        '        if e.errno not in (errno.ENOSPC, errno.EDQUOT):',
        '        os.pwrite(fd, note, 0)\n        os.ftruncate(fd, len(note))\n    except OSError as e:\n'
        '        if True:',
        'tests/test_ssd_disk_full.py::test_restart_on_a_disk_another_file_filled',
    ),
    (
        'partial journal append left behind (issue 28)',
        'storage_backends/ssd/journal.py',
        '        except OSError:\n            self._cut_back(start)\n            raise\n',
        '        except OSError:\n            raise\n',
        'tests/test_ssd_reliability.py::test_an_append_cut_short_by_a_full_disk_leaves_whole_records',
    ),
    (
        'host pool freed under queued SSD writes (issue 28)',
        'storage_backends/lmcache/backend.py',
        '        _end_writes_before_pool_closes(local_cpu_backend, self.tier)\n',
        '',
        'tests/test_lmcache_plugin.py::test_lmcache_frees_its_host_pool_only_after_the_ssd_writes_end',
    ),
    (
        'episodes end at the first lucky success (issue 28, soak)',
        'storage_backends/ssd/episodes.py',
        'if not n or self._clock() - self._last.get(kind, 0.0) < SETTLE_S:',
        'if not n:',
        'tests/test_ssd_reliability.py::test_an_episode_ends_only_after_it_settled',
    ),
    (
        'adaptive: never changes its leader',
        'storage_backends/eviction/adaptive.py',
        '            if margin > best_margin:',
        '            if margin > best_margin and False:',
        'tests/test_eviction_adaptive.py::test_follows_the_better_expert_and_switches_when_the_traffic_changes',
    ),
    (
        'adaptive: a lead without the paired test',
        'storage_backends/eviction/adaptive.py',
        'margin = self.diff[i][lead] / g - z * math.sqrt(self.sq[i][lead] / g)',
        'margin = self.diff[i][lead] / g',
        'tests/test_eviction_adaptive.py::test_a_lead_made_of_noise_does_not_switch',
    ),
    (
        'adaptive: residents the leader dropped are not evicted first',
        'storage_backends/eviction/adaptive.py',
        'key = next((k for k in self._doomed if free(k)), None)',
        'key = None',
        'tests/test_eviction_adaptive.py::test_after_a_switch_the_old_leaders_residents_go_first',
    ),
    (
        "adaptive: the leader's shadow does not make room before the tier evicts",
        'storage_backends/eviction/adaptive.py',
        '                self._leader_makes_room(need)\n',
        '',
        'tests/test_eviction_adaptive.py::test_one_expert_is_that_expert',
    ),
    (
        'adaptive: pinned residents evicted',
        'storage_backends/eviction/adaptive.py',
        'return k in self._resident and k not in taken and evictable(k)',
        'return k in self._resident and k not in taken',
        'tests/test_eviction_adaptive.py::test_victims_skip_pins_and_free_enough_bytes_when_collected_first',
    ),
    (
        'ssd stream: foreign chunk format accepted',
        'connector/ssd_stream.py',
        'return (meta.fmt == want.fmt.name and meta.dtype == str(want.dtype)',
        'return True or (meta.fmt == want.fmt.name and meta.dtype == str(want.dtype)',
        'tests/test_connector_ssd_stream.py::test_another_models_chunks_are_misses_never_written',
    ),
    (
        'ssd stream: a missing chunk skipped, the rest written',
        'connector/ssd_stream.py',
        '                if obj is None:\n                    break\n',
        '                if obj is None:\n                    continue\n',
        'tests/test_connector_ssd_stream.py',
    ),
    (
        'ssd stream: host copies never released',
        'connector/ssd_stream.py',
        '                    for obj in taken:\n                        obj.ref_count_down()\n',
        '                    for obj in taken:\n                        pass\n',
        'tests/test_connector_ssd_stream.py::test_a_chunk_only_in_the_host_tier_is_taken_from_there_and_released',
    ),
    (
        'device read: checksum skips the last piece',
        'storage_backends/ssd/slot_io.py',
        '        if list(h.crcs) != crcs:',
        '        if list(h.crcs)[:-1] != crcs[:-1]:',
        'tests/test_connector_ssd_stream.py::test_device_reads_verify_every_chunk',
    ),
    (
        'prefetch stages SSD chunks in host memory under device reads',
        'connector/worker_storage.py',
        '                    if self.direct_ssd:  # the load streams it',
        '                    if False:  # the load streams it',
        'tests/test_connector_ssd_stream.py::test_prefetch_leaves_ssd_chunks_to_a_device_stream',
    ),
    (
        'gpu checksum: the last piece of a segment skipped',
        'kernels/crc32.py',
        '        last = max(first + 1, -(-hi // piece))',
        '        last = max(first + 1, -(-hi // piece) - 1)',
        'tests/test_kernels_crc32.py '
        'tests/test_connector_ssd_stream.py::test_a_byte_gone_bad_in_device_memory_is_a_miss',
    ),
    (
        'gpu checksum: tail bytes skipped (torch)',
        'kernels/crc32.py',
        '        for j in range(words * 4, n):',
        '        for j in range(words * 4, words * 4):',
        'tests/test_kernels_crc32.py',
    ),
    (
        'io_engine auto: the compat mode of kvikio taken for GPUDirect Storage',
        'storage_backends/ssd/kvikio_io.py',
        '        if gds:',
        '        if True:',
        'tests/test_ssd_io_engine.py',
    ),
    (
        'host read: a checksum mismatch accepted',
        'storage_backends/ssd/slot_io.py',
        '        if list(h.crcs) != crcs:',
        '        if False:',
        'tests/test_ssd_faults.py tests/test_ssd_fuzz.py',
    ),
    (
        'gpu checksum: the last piece skipped (triton)',
        'kernels/crc32_triton.py',
        '        _crc32_segments[(aligned,)](',
        '        _crc32_segments[(aligned - 1,)](',
        'tests/test_kernels_crc32.py::test_triton_kernel_equals_zlib_under_the_interpreter',
    ),
    (
        'gpu checksum: a piece not advanced to its segment end (triton)',
        'kernels/crc32_triton.py',
        '            lin = _advance(lin, pow_tab_ptr + bit * 1024)',
        '            lin = _advance(lin, pow_tab_ptr + bit * 0)',
        'tests/test_kernels_crc32.py::test_triton_kernel_equals_zlib_under_the_interpreter',
    ),
    (
        'gpu checksum: an odd tail read as whole words (triton)',
        'kernels/crc32_triton.py',
        '                              BLOCK=block, BYTEWISE=True)',
        '                              BLOCK=block, BYTEWISE=False)',
        'tests/test_kernels_crc32.py::test_triton_kernel_equals_zlib_under_the_interpreter',
    ),
    (
        'vllm tier: a store job finished before its chunks commit',
        'storage_backends/vllm_offload/secondary_tier.py',
        'state = _StoreJob(job.job_id, left=len(keys) + 1, started=time.monotonic())',
        'state = _StoreJob(job.job_id, left=1, started=time.monotonic())',
        'tests/test_vllm_offload_tier.py',
    ),
    (
        'vllm tier: a failed load reported as success',
        'storage_backends/vllm_offload/secondary_tier.py',
        '        ok = len(loaded) == len(keys)',
        '        ok = True',
        'tests/test_vllm_offload_tier.py',
    ),
    (
        'vllm tier: the layout left out of the directory',
        'storage_backends/vllm_offload/secondary_tier.py',
        '        return cls(mapper.get_run_config(), chunk_bytes)',
        '        return cls({"model_name": "any"}, chunk_bytes)',
        'tests/test_vllm_offload_tier.py',
    ),
    (
        'vllm policy: a request\'s reuse not passed to the kvtier policy',
        'storage_backends/vllm_offload/cache_policy.py',
        '            if key in reused_keys and key in self.chunks:',
        '            if False:',
        'tests/test_vllm_offload_policy.py',
    ),
    (
        'vllm policy: evict ignores vLLM\'s protected chunks',
        'storage_backends/vllm_offload/cache_policy.py',
        'lambda k: k in self._evictable and k not in protected)',
        'lambda k: k in self._evictable)',
        'tests/test_vllm_offload_policy.py',
    ),
    (
        'tp2: a rank\'s failed loads not reported to vLLM (rank 1)',
        'connector/worker_transfers.py',
        '            self._load_errors.update(blocks)',
        '            self._load_errors.update(blocks if self.rank == 0 else ())',
        'tests/test_connector_tp2.py',
    ),
    (
        'tp2: the usable prefix taken from the rank that holds the most',
        'connector/messages.py',
        '        hit = min(r.hit_end for r in results)',
        '        hit = max(r.hit_end for r in results)',
        'tests/test_connector_tp2.py',
    ),
    (
        'LMCache host policy: session signals without the adapter lock',
        'storage_backends/lmcache/host_policy.py',
        '            session_signals.register(self.policy, lock=self.lock)',
        '            session_signals.register(self.policy)',
        'tests/test_policy_wiring.py::test_host_policy_survives_session_signals_from_another_thread',
    ),
    (
        'session signals: a failing policy stops the fan-out and reaches the caller',
        'storage_backends/eviction/session_signals.py',
        '        except Exception:\n            _failed(policy)\n',
        '        except Exception:\n            raise\n',
        'tests/test_policy_wiring.py::test_a_failing_session_signal_sink_is_logged_and_skipped',
    ),
    (
        'identity: the request\'s tag left out of LMCache\'s keys (connector)',
        'connector/worker_storage.py',
        '    return {IDENTITY_TAG: tag} if tag else None',
        '    return None',
        'tests/test_identity.py::test_lmcache_keys_with_identity_tags_keep_tenants_apart_in_host_and_ssd',
    ),
    (
        'identity: the cache salt left out of the request\'s tag',
        'identity/request.py',
        '        if salt:\n            parts.append(["salt", str(salt)])',
        '        if False:\n            parts.append(["salt", str(salt)])',
        'tests/test_identity.py',
    ),
    (
        'identity: multimodal placeholders left as they are',
        'identity/request.py',
        '                out[offset + j] = -1 - (base + j) % _MM_SPACE',
        '                pass',
        'tests/test_identity.py',
    ),
    (
        'identity: the scheduler side\'s chunk keys without the tag (a tenant waits for another\'s chunks)',
        'connector/scheduler_state.py',
        '    keys, h = [], hash(tag) if tag else 0',
        '    keys, h = [], 0',
        'tests/test_identity.py',
    ),
    (
        'identity: the weights left out of the fingerprint',
        'identity/model.py',
        '        return {"weights": f"{self.weights.source}:{self.weights.digest}", "config": self.config,',
        '        return {"weights": self.weights.source, "config": self.config,',
        'tests/test_identity.py',
    ),
    (
        'identity: weights fingerprinted by name and size only',
        'identity/model.py',
        '        h.update(_sample(f, size))',
        '        pass',
        'tests/test_identity.py',
    ),
    (
        'identity: the SSD tier\'s namespace not applied to keys',
        'identity/namespace.py',
        '        return self.prefix + key if self.name else key',
        '        return key',
        'tests/test_identity.py',
    ),
    (
        'identity: foreign chunks not reclaimed first',
        'storage_backends/ssd/index.py',
        '        foreign = next((k for k in self._foreign if evictable(k)), None)',
        '        foreign = None',
        'tests/test_identity.py',
    ),
    (
        'identity: MP keys without the weights\' fingerprint',
        'storage_backends/lmcache/mp_adapter.py',
        '        return key_string(key, self._weights(key.model_name))',
        '        return key_string(key, "w")',
        'tests/test_lmcache_mp_adapter.py::test_salts_keep_tenants_apart_and_new_weights_under_the_same_path_miss',
    ),
    (
        'identity: vLLM\'s offloading tier without the KV identity\'s namespace',
        'storage_backends/vllm_offload/secondary_tier.py',
        'namespace=self.fingerprint.namespace)',
        'namespace="")',
        'tests/test_vllm_offload_tier.py::test_salted_requests_and_new_weights_never_share_chunks',
    ),
    (
        'sealing: chunks written in the clear',
        'storage_backends/ssd/tier_writes.py',
        '            return self.sealer.seal(t.key, t.meta, t.buf, buf)',
        '            return t.meta, t.buf',
        'tests/test_ssd_sealing.py',
    ),
    (
        'sealing: a chunk that fails authentication served',
        'storage_backends/ssd/sealing.py',
        '        except InvalidTag:\n            return False',
        '        except InvalidTag:\n            return True',
        'tests/test_ssd_sealing.py',
    ),
    (
        'sealing: the secret left out of the namespace',
        'storage_backends/ssd/tier.py',
        '            namespace = "m" + digest([namespace, "sealed", self.sealer.key_id])[:20]',
        '            pass',
        'tests/test_ssd_sealing.py',
    ),
    (
        'sealing: one key for every tenant',
        'storage_backends/ssd/sealing.py',
        '                 info=tenant.encode("utf-8", "surrogatepass")).derive(self._secret)',
        '                 info=b"").derive(self._secret)',
        'tests/test_ssd_sealing.py',
    ),
    (
        'sealing: a shared-store envelope not bound to its key',
        'storage_backends/shared/sealed.py',
        '    return (store_key + "|" + json.dumps(layout, sort_keys=True, separators=(",", ":"))).encode()',
        '    return json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()',
        'tests/test_shared_tier.py::test_sealed_chunks_travel_as_envelopes_and_open_only_with_the_secret',
    ),
    (
        'lost hits: a save counts as landed when it is issued',
        'connector/scheduler_accounting.py',
        '        self.ledger.save_issued(job, st.rid, st.tag, key_tokens, start, end)\n',
        '        self.ledger.save_issued(job, st.rid, st.tag, key_tokens, start, end)\n'
        '        self.ledger.save_done(job)\n',
        'tests/test_lost_hits_engine.py',
    ),
    (
        'lost hits: the alignment tail left out of the partition',
        'telemetry/lost_hits.py',
        '"not_found": ideal - max(start, whole)}',
        '"not_found": ideal - whole}',
        'tests/test_lost_hits.py',
    ),
    (
        'host tier: what a load read never reaches the eviction policy',
        'connector/worker_storage.py',
        '        report_host_hits(self.host, [k for k in retrieved if k not in staged])\n',
        '',
        'tests/test_connector_ssd_stream.py::test_chunks_a_load_read_are_hits_for_the_host_tiers_policy',
    ),
    (
        'host tier: the chunks a request\'s own prefetch staged reported as host hits',
        'connector/worker_storage.py',
        '[k for k in retrieved if k not in staged]',
        'retrieved',
        'tests/test_connector_ssd_stream.py::test_chunks_a_prefetch_staged_are_no_host_hits_for_its_own_load',
    ),
    (
        'engine walk: a chunk staged from SSD reported as a host hit',
        'replay/engine_walk.py',
        '            if k in host and k not in staged:\n',
        '            if k in host:\n',
        'tests/test_engine_walk.py',
    ),
    (
        "engine walk: vLLM's free queue takes a finished prefix's head first",
        'replay/gpu_prefix_cache.py',
        '        for p in reversed(run.pages):\n',
        '        for p in run.pages:\n',
        'tests/test_engine_walk.py',
    ),
    (
        "engine walk: vLLM's prefix cache reuses the prompt's last token",
        'replay/gpu_prefix_cache.py',
        '        limit = (prompt_tokens - 1) // self.page_tokens\n',
        '        limit = prompt_tokens // self.page_tokens\n',
        'tests/test_engine_walk.py',
    ),
    (
        "engine walk: host chunks past an SSD gap counted as SSD hits (not as the connector counts them)",
        'replay/engine_walk.py',
        '        disk = overlap(g, end, host_run * c, (host_run + len(ssd_only)) * c)\n',
        '        disk = overlap(g, end, host_run * c, found * c)\n',
        'tests/test_engine_walk.py',
    ),
]
only = sys.argv[1:]
env = dict(os.environ, LMCACHE_TRACK_USAGE="false", VLLM_TARGET_DEVICE="cpu",
           PYTHONPATH=os.path.join(ROOT, ".kvtier-import"))  # this clone's sources (scripts/env.sh)
missed = 0
for name, f, old, new, tests in MUTS:
    if only and not any(o in name for o in only):
        continue
    p = os.path.join(ROOT, f)
    with open(p) as fh:
        src = fh.read()
    if src.count(old) != 1:
        print(f"[STALE] {name}: pattern found {src.count(old)} times (update the snippet: a check that no longer "
              "applies proves nothing)")
        missed += 1
        continue
    backup = os.path.join(tempfile.gettempdir(), "kvtier-mutation-backup")
    shutil.copy(p, backup)
    try:
        with open(p, "w") as fh:
            fh.write(src.replace(old, new))
        r = subprocess.run(f"timeout 600 .venv/bin/pytest -p no:warnings -q -x {tests}", shell=True, cwd=ROOT,
                           env=env, capture_output=True, text=True)
        last = [line for line in r.stdout.splitlines() if line.strip()][-1:]
        broken = r.returncode in (2, 3, 4, 5)  # interrupted, internal error, usage, no tests: nothing was checked
        print(f"[{'BROKEN' if broken else 'CAUGHT' if r.returncode else 'MISSED'}] {name}: {last}", flush=True)
        missed += r.returncode == 0 or broken
    finally:
        shutil.copy(backup, p)
sys.exit(1 if missed else 0)

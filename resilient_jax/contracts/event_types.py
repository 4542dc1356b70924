"""Every event type a run writes to `events.jsonl`, with the fields it carries.

An event is one JSON object per line with at least `time` (unix seconds) and `type`; the writer
adds `process`, `slice`, `pid` and `generation` where it knows them. The fields listed here are the
ones each type adds. `EventType` members are `str`s, so they compare equal to the strings read
back from a file and serialise as plain strings.
"""

from __future__ import annotations

from resilient_jax.contracts.names import Name


class EventType(Name):
    # A worker's life.
    # A worker's own: topology, mesh. The supervisor's (source supervisor): pid, process, slice,
    # host, generation, num_processes, num_slices, standby (its agent made a warm standby it).
    PROCESS_START = "process_start"
    JAX_INIT = "jax_init"  # duration_s, num_processes, coordinator
    INIT = "init"  # duration_s; source: the checkpoint.init_from_hf directory (else the seed)
    RESTORE = "restore"  # step, tier, duration_s, source
    COMPILE = "compile"  # duration_s, cache, program (train | eval)
    # A program compiled (or loaded) in a thread beside training, blocking nothing: duration_s,
    # cache, program. Goodput does not count it (the steps around it do).
    COMPILE_BACKGROUND = "compile_background"
    COMPILE_CACHE_INVALID = "compile_cache_invalid"  # path, cause
    STEP = "step"  # step, loss, step_time_s, ... (one per logged step)
    STOP = "stop"  # reason, exit_code
    # Checkpoints.
    # step, tier, duration_s (time the save blocked training); skipped: saves of the tier skipped
    # since its previous save because its writer was still busy (local tier), when any
    SAVE = "save"
    SAVE_COMMITTED = "save_committed"  # step, tier, duration_s (from the save's start)
    SAVE_FAILED = "save_failed"  # step, tier, cause
    # How saves hold the state while the tiers read it (checkpoint.keep_state), chosen at the
    # checkpointer's start: method (keep | copy_to_host), why; with auto, device_bytes,
    # steady_bytes and save_peak_bytes (the plan's, per device).
    SAVE_METHOD = "save_method"
    CHECKPOINT_INTERVAL = "checkpoint_interval"  # tier, every_steps, cost_s, mtbf_s
    CHECKPOINT_INVALID = "checkpoint_invalid"  # step, tier, cause: skipped on restore
    CHECKPOINT_QUARANTINED = "checkpoint_quarantined"  # step, path, cause
    # Local-tier pieces this host lacked, fetched from peer hosts for a restore:
    # step, bytes, pieces, peers (their tier servers), duration_s.
    LOCAL_FETCH = "local_fetch"
    LOCAL_FETCH_FAILED = "local_fetch_failed"  # cause: a peer host that did not list its copies
    # The persistent tier stopped answering (a save failed or hung, a probe got no answer, or it
    # was unreachable at start): training goes on with the local tier.
    PERSISTENT_OUTAGE = "persistent_outage"  # step, cause
    PERSISTENT_RECOVERED = "persistent_recovered"  # step (the first committed since), outage_s
    PREEMPTION = "preemption"  # step: a SIGTERM was agreed on; save and stop
    # In-band health.
    ANOMALY = "anomaly"  # step, cause, loss, grad_norm, z
    ROLLBACK = "rollback"  # step, from_step, cause, skips
    HANG = "hang"  # phase, idle_s: the watchdog ends the process
    # The supervisor's view and decisions.
    FAILURE_DETECTED = "failure_detected"  # process, slice, cause, exit_code, latency_s
    EVICT = "evict"  # slice, cause, for_s
    RESTART = "restart"  # generation, slices, mesh, cause
    SCALE_UP = "scale_up"  # slices: a returned slice is re-admitted
    SCALE_UP_DEFERRED = "scale_up_deferred"  # slices, gain_s, cost_s: not worth a restart yet
    READMIT = "readmit"  # slice: an evicted slice's cool-down is over
    STRAGGLER = "straggler"  # process, slice, ratio, median_s, reference_s
    # A slice was lost or returned: how the job goes on. trigger (slice_lost | slice_returned),
    # policy, plan (spare | reshape | wait | readmit | defer), slices, expected_s, why,
    # alternatives ([{plan, slices, expected_s, why}]), step_s ({slices: s}), restart_s, mtbf_s,
    # return_in_s, remaining_steps: each plan's expected wall time to the end of the run.
    RECONFIGURE = "reconfigure"
    # Hosts and the control channel.
    AGENT_START = "agent_start"  # pid, host, slice, devices, slots: a host agent is up
    HOST_JOINED = "host_joined"  # host, slice, agent_pid, probe: registered, health probe passed
    HOST_PROBE_FAILED = "host_probe_failed"  # host, slice, detail: not admitted
    HOST_LOST = "host_lost"  # host, slice, cause (silent | disconnected), silent_s
    SUPERVISOR_ATTACH = "supervisor_attach"  # host, slice, agent_pid, workers: an agent attached
    # peer (host:port), why: a control-port connection closed for what it sent or did not send
    # (no or a wrong run token, an over-long line, silent past coordinator.auth_timeout_s, one
    # unauthenticated connection too many). At most coordinator.refusals_logged_per_peer per
    # peer host and coordinator.refusal_log_window_s; the rest are counted, and when the window
    # ends: peer (host), count, reasons ({why: count}), window_s. The two add up to every refusal.
    CONNECTION_REFUSED = "connection_refused"
    CONNECTION_REFUSALS_SUPPRESSED = "connection_refusals_suppressed"
    AGENT_ORPHANED = "agent_orphaned"  # host, waited_s: no supervisor; workers asked to save
    # Fault injection.
    CHAOS = "chaos"  # kind, fault, step: written by the process a fault hits, before it acts
    FAULT_INJECTED = "fault_injected"  # action, slice, process: faults the supervisor carries out
    # Evaluation and profiling.
    # step, duration_s, batches, eval_loss, eval_perplexity, eval_loss/NAME (eval.datasets):
    # training paused for it
    EVAL = "eval"
    # Continual pretraining: the base model wrote chunk `chunk` (`sequences` of them, in
    # duration_s) of the synthetic rehearsal set; `complete` once the set is whole.
    REHEARSAL = "rehearsal"
    PROFILE = "profile"  # action (start | stop), duration_s; at stop: first_step, last_step, path
    # Elastic mode (resilient_jax.elastic), in each slice's own event log.
    # quorum_id, slices, rank, duration_s (forming the exchange group), from_step
    ELASTIC_QUORUM = "elastic_quorum"
    # The elastic supervisor's: slice, pid (a slice's worker started: at the job's start or as a
    # replacement; standby: true when a warm standby was given the slice); slice, exit_code,
    # failures (it exited non-zero; the others train on), or
    # slice, exit_code, reason (ended by the supervisor: the run finished before it joined)
    ELASTIC_SLICE_START = "elastic_slice_start"
    ELASTIC_SLICE_EXIT = "elastic_slice_exit"
    # slice, pid: a restarted elastic supervisor took over a slice still running (not restarted)
    ELASTIC_SLICE_ADOPTED = "elastic_slice_adopted"
    # The elastic supervisor's, of its warm standby slice (elastic.standby): pid, adopted (a
    # restarted supervisor took over the one still running); pid, exit_code (it ended unused)
    ELASTIC_STANDBY_START = "elastic_standby_start"
    ELASTIC_STANDBY_EXIT = "elastic_standby_exit"
    # The standby's own: ready (in its own log: it waits at the join point; its start is the
    # supervisor's elastic_standby_start); assigned (in the slice's log: slice, waited_s idle)
    ELASTIC_STANDBY_READY = "elastic_standby_ready"
    ELASTIC_STANDBY_ASSIGNED = "elastic_standby_assigned"
    # slices, quorum_id, carried_over (the slices' own quorum kept: no group re-formed), after_s
    # (from listening again to the first quorum): the adopted slices are back in a quorum
    ELASTIC_RECONNECTED = "elastic_reconnected"
    ELASTIC_EXCHANGE_FAILED = (
        "elastic_exchange_failed"  # step, quorum_id, error: the step is redone
    )
    # step (the state's after healing), source_slice, bytes, duration_s, role (sent | received)
    ELASTIC_HEAL = "elastic_heal"
    # step, quorum_id, slices, owned (the global batch's parts this slice computed), digest
    # (sha256 of the parameters, every elastic.check_every_steps), compute_s (its parts' gradient
    # sums, on the host), exchange_s (the exchange alone); reused (parts whose rows were kept from
    # a failed exchange of the step, not computed again), only when there are some
    ELASTIC_STEP = "elastic_step"
    # With a sync interval: step, from_step, quorum_id, owned (a failed sync's round, trained
    # again from its start under the new quorum); elastic_step then carries synced (the round's
    # outer step was made)
    ELASTIC_ROUND_REDONE = "elastic_round_redone"

"""The messages between parameter-server workers and servers: tags, header layouts, flags.

Push (worker -> server, `TAG_PIECE` pieces then the `TAG_PUSH` header): `[clock, loss, flags |
the gradient elements the rank owns in the server's range]`, in the parameters' dtype. Pull
(server -> worker, `TAG_PULL`): `[loss, norm, flags, staleness, stop_at | every parameter element
the rank holds in the server's range]`. The index lists behind both are sent once (`TAG_SETUP`,
when `client.ParameterClient` is built); per step only values travel.

Per server and step, bytes in = 8 * (3 W + R * P/S) (float64; float32 halves the values), bytes
out = 8 * (5 W + sum over worker ranks of the elements each holds in the range): every replica
pushes the range once, and pulls it once plus what its tp ranks hold twice (tp-replicated
parameters) and the tied head copy (W worker ranks, R replicas, P parameters, S servers).
"""

TAG_SETUP, TAG_PUSH, TAG_PULL, TAG_PIECE = 7601, 7602, 7603, 7604
PUSH_HEADER = 3   # clock, loss (sum over the rank's micro-batches; 0 off the loss ranks), flags
PULL_HEADER = 5   # loss, norm, flags, staleness, stop_at
FLAG_SKIP = 1     # pull: the step was skipped (a non-finite gradient norm or loss)
FLAG_PREEMPT = 2  # push: this rank was signalled to stop
BYE = -1          # push clock: this worker's run has ended

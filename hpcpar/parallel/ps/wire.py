"""The messages between parameter-server workers and servers: tags, header layouts, flags.

Push (worker -> server, `TAG_PIECE` pieces then the `TAG_PUSH` header): `[clock, loss, flags |
the gradient elements the rank owns in the server's range]`, in the parameters' dtype. Pull
(server -> worker, `TAG_PULL`): `[loss, norm, flags, staleness, stop_at, rows | every parameter
element the rank holds in the server's range]`. The index lists behind both are sent once
(`TAG_SETUP`, when `client.ParameterClient` is built); per step only values travel.

A row-sparse parameter (an untied wte, `Parameter.sparse_grad`, with train.sparse_embedding =
"auto") travels apart, by rows. At setup a rank holding one sends each server, per local row,
the run of positions the row has in the server's range (`ownership.row_runs`: first, count).
Per step, before the header, to each server whose range holds some of its rows: `TAG_ROW_IDS`,
int64 `[n_push, n_want | push row ids | want row ids]` (local row ids, ascending), and
`TAG_ROW_VALUES`, the pushed rows' elements in the range, back to back in id order. n_push = -1
(`DENSE`): every row in the range follows, taken when the pairs are not fewer bytes; n_want = -1:
the rank does not know its next batch (the run's last step). The pushed rows are the nonzero
ones; the wanted, those the rank's next step looks up. The pull appends, after the dense part,
the wanted rows' elements in the range in the order asked (`rows` = n_want), or every row's
(`rows` = -1): at a sync point (evaluation, checkpoint, the end, a preemption stop) and whenever
the wanted rows are not fewer bytes, so every sync point sees the whole table (a preemption stop
under SSP or async: from each server once it has seen the signal, which a server other than 0 may
learn after answering the last pull; the workers save nothing, the servers hold the model).

Per server and step, bytes in = 8 * (3 W + R * P/S) (float64; float32 halves the values), bytes
out = 8 * (6 W + sum over worker ranks of the elements each holds in the range): every replica
pushes the range once, and pulls it once plus what its tp ranks hold twice (tp-replicated
parameters) and the tied head copy (W worker ranks, R replicas, P parameters, S servers). A
row-sparse parameter's part of the range, E elements, is instead, per worker rank holding it
(a tp shard's rows on each tp rank of the first stage), in: 8 (2 + k + k') + s e(k) (k pushed,
k' wanted rows, e(.) their elements in the range; s e(E) for the values when dense), out:
s e(k'), or s E when dense; e(k) is k C where no range boundary cuts a row.
"""

TAG_SETUP, TAG_PUSH, TAG_PULL, TAG_PIECE = 7601, 7602, 7603, 7604
TAG_ROW_IDS, TAG_ROW_VALUES = 7605, 7606
PUSH_HEADER = 3   # clock, loss (sum over the rank's micro-batches; 0 off the loss ranks), flags
PULL_HEADER = 6   # loss, norm, flags, staleness, stop_at, rows (row-sparse: the wanted rows' count, -1 every row)
FLAG_SKIP = 1     # pull: the step was skipped (a non-finite gradient norm or loss)
FLAG_PREEMPT = 2  # push: this rank was signalled to stop
BYE = -1          # push clock: this worker's run has ended
DENSE = -1        # row messages: n_push, n_want or the pull's rows: every row in the range

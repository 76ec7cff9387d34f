"""The text the demo's tokenizer vocabulary is trained on (workers/demo_text.py): a few KB of
plain English written for tgw (no licence to carry), about serving models, since the demo's
`embed-text` traffic talks about the same things."""

CORPUS = """\
A model server takes requests from many callers and answers each one with the output of a model.
The callers send images, text and records. The server decodes the images, resizes them and scales
their pixels; it splits the text into tokens and looks the tokens up in a vocabulary; then it runs
the model on a batch of rows and turns the scores back into labels that a person can read.

Batching matters because a model computes a batch of sixteen rows in little more time than one row.
The broker waits a short while for more requests to arrive, forms a batch, and copies it into the
shared memory of a worker process. The worker runs the batch in place and writes its outputs to an
arena of its own. The broker then answers every caller whose rows were in the batch.

A pipeline is a chain of steps. The first step decodes a picture, the second step classifies it, and
the third step keeps the five best classes with their scores. Each step is batched on its own, so four
pictures that arrive together are decoded together, and the classifier takes whatever rows are ready.
The data moves from one step to the next inside the machine and never goes back through the caller.

When a picture is broken, only its own request fails. The caller hears a clear message that says the
file is not a decodable image, while the other pictures of the same batch are answered as usual. A
deadline covers the whole pipeline: a request that can no longer finish in time is not sent on to its
next step, because nobody would read the answer.

The weather was mild in the morning. The river ran slowly past the old mill, and children walked along
the bank to the school on the hill. A baker opened his shop at six and sold warm bread to the first
workers of the day. In the afternoon the wind turned to the west and brought a light rain over the
fields, and the farmers hurried to bring the hay into the barns before the evening.

Good software is easy to read. Names explain themselves, comments say why and not what, and every piece
of state has one writer. Errors name the thing that was wrong and what was expected instead. Tests wait
for something they can observe rather than sleeping for a fixed time, and they use real processes,
real sockets and real shared memory instead of imitations of them.

A tokenizer learns its vocabulary from text. It starts with single letters and merges the pairs that
occur most often into longer pieces, until the vocabulary has the size it was asked for. Common words
become single tokens; rare words are spelled out of several smaller pieces. Every piece has a number,
and the model sees only the numbers. Sentences of different lengths are padded or cut to one length so
that many of them fit in one rectangular batch.

An embedding model maps a sentence to a vector of numbers. Sentences with similar meaning land close to
each other, and the distance between two vectors tells how alike the sentences are. Before comparing
them the vectors are scaled to unit length, so that only their direction counts. Search engines,
recommendation systems and question answering all rely on such vectors, computed for millions of texts.

The night sky was clear over the mountains. Stars filled it from one edge to the other, and the milky
way stretched across the middle like a river of light. An owl called from the forest, a fox crossed the
meadow, and far below in the valley the lights of the village went out one after another as people went
to sleep. Only the lighthouse on the coast kept turning, sending its beam across the dark water.

Measuring comes before choosing. Time each way of doing the work on the machine that will do it, with
the inputs it will see, and keep the numbers next to the decision. A fast path that nobody measured is a
guess. Throughput, latency at the median and at the tail, the processor time spent per request and the
memory held are the figures that decide whether a server is good enough for the people who depend on it.
"""

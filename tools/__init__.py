"""Tooling around kvtier that is not production code: trace readers, the eviction replay (`kvtier replay`), the
scheduling simulator and its cost model (`kvtier simulate`), and the LMCache engine factory used by demos, tests
and benchmarks. Nothing in kvtier's production path (connector, storage backends, scheduler hooks) imports this
package."""

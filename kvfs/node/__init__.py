"""One node's file service: POSIX operations over the local tiers, its membership in a
cluster, its copies of directories' names and the prefetches started by lookups."""

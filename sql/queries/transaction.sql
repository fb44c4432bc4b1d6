-- begin --
-- Open a transaction inside a pipeline (see payhook.db.pipelined_transaction).
BEGIN ISOLATION LEVEL READ COMMITTED

-- commit --
-- Commit it.
COMMIT

-- rollback --
-- Abandon it.
ROLLBACK

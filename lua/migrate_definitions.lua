-- migrate_definitions: give a tag's budget definitions the ledger id as the current format
-- keeps it (core/stores/migrate.py, `ceiling ledger migrate`).
--
-- KEYS: definition hashes 'sc:{TAG}:def:<budget_id>' of one tag
-- ARGV: ledger_id, suffix (what format 1 put after the ledger id of a definition with a week,
--       a rate or per-user limits), write ('1': rewrite them; '0': count only)
-- Returns the number of the definitions that carried the suffix (and, with write '1', no
--   longer do).
-- Why: the current format reads a definition's ledger id as it is (lib.lua resolve_legs), so a
-- definition that still carried the suffix would be refused as another ledger's. One tag's keys
-- are one slot; a definition without the suffix is left as it is, so a second run changes
-- nothing.
local ledger_id, write = ARGV[1], ARGV[3] == '1'
local suffixed = ledger_id .. ARGV[2]
local found = 0
for _, key in ipairs(KEYS) do
  if redis.call('HGET', key, DEFINITION_FIELDS[1]) == suffixed then
    found = found + 1
    if write then
      redis.call('HSET', key, DEFINITION_FIELDS[1], ledger_id)
    end
  end
end
return found

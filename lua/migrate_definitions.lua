-- migrate_definitions: give a tag's budget definitions the ledger id and the alert fields as
-- the current format keeps them (core/stores/migrate.py, `ceiling ledger migrate`).
--
-- KEYS: definition hashes 'sc:{TAG}:def:<budget_id>' of one tag
-- ARGV: ledger_id, suffix (what format 1 put after the ledger id of a definition with a week,
--       a rate or per-user limits), write ('1': rewrite them; '0': count only), thresholds
--       (what a definition put before alerts alerts on: core/alerts.py THRESHOLDS_PCT_DEFAULT)
-- Returns the number of the definitions that carried the suffix or lacked an alert field (and,
--   with write '1', no longer do).
-- Why: the current format reads a definition's ledger id as it is (lib.lua resolve_legs), so a
-- definition that still carried the suffix would be refused as another ledger's; and it reads
-- the alert fields put_budget writes on every definition (lib.lua alert_thresholds, get_budget).
-- One tag's keys are one slot; a definition as the current format keeps it is left as it is,
-- so a second run changes nothing.
local ledger_id, write, thresholds = ARGV[1], ARGV[3] == '1', ARGV[4]
local suffixed = ledger_id .. ARGV[2]
local found = 0
for _, key in ipairs(KEYS) do
  -- The budgets index may still name a budget deleted after its definition: nothing to
  -- migrate there, and a write would leave a definition of alert fields alone.
  if redis.call('HEXISTS', key, DEFINITION_FIELDS[2]) == 1 then
    local suffix = redis.call('HGET', key, DEFINITION_FIELDS[1]) == suffixed
    local alerts = redis.call('HEXISTS', key, 'alert_thresholds_pct') == 0
        or redis.call('HEXISTS', key, 'alert_velocity') == 0
    if suffix or alerts then
      found = found + 1
    end
    if write and suffix then
      redis.call('HSET', key, DEFINITION_FIELDS[1], ledger_id)
    end
    if write and alerts then
      redis.call('HSETNX', key, 'alert_thresholds_pct', thresholds)
      redis.call('HSETNX', key, 'alert_velocity', '')
    end
  end
end
return found

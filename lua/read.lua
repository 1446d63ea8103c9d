-- read: one reservation as it is kept, for its owner's read or an operator's.
--
-- KEYS[1] meta hash   KEYS[2] reservation
-- ARGV: wire.py READ_ARGS: [now_ms]
-- Returns {'found', record (wire.py RECORD_FIELDS, packed)} or {'none'}.
-- Why: a reservation is kept as a string by wire.py RECORD_FIELDS, which only the scripts
-- unpack (lib: load_record); read here, it reaches Python as one packed record.
local rec = load_record(KEYS[2])
if not rec then
  return {'none'}
end
return {'found', pack_record(rec)}

-- cas: for each of several groups of keys (one batch of decisions each,
-- independent of the others), write the group's keys only if none changed
-- since the decision was made on them, and (when the decision's time is
-- checked) only if that time is Redis's within a tolerance. Each key is a
-- hash: v = the value (bytes decided by the service), t = its tag byte
-- (absent on values stored before values carried one), n = its version
-- (chosen by the writer; absent = the key is absent); turn, turn_until = an
-- instance that lost too many races in a row and, until then (µs), the
-- only one whose write the key takes.
-- KEYS               every group's keys, group after group (one hash tag)
-- ARGV[1]            the decisions' time, µs since the epoch ('' = no check)
-- ARGV[2]            how far it may be from TIME, µs
-- ARGV[3]            the deciding instance
-- ARGV[4]            how long a turn lasts, µs
-- ARGV[5]            G, the number of groups
-- ARGV[6]            '1': this script was sent before (its connection
--                    dropped): groups whose marks it finds were written then
-- ARGV[7]            '1': mark every key written (field w:<ARGV[3]> = the
--                    version written), so that a resend knows ('0': no marks)
-- ARGV[6 + 2g]       group g's number of keys
-- ARGV[7 + 2g]       '1': group g claims its keys' turn when not written
--                    (all of them, or none while another instance holds
--                    the turn of one)
-- then, per key i (from A = 8 + 2G): ARGV[A + 5(i-1)] the version the
--                    decision saw ('' = absent); + 1 the new version; + 2
--                    the new value ('' = leave the key as it is, only check
--                    it); + 3 its time to live in ms; + 4 its tag
-- Returns {seconds, µs (TIME), s1, ..., sG}: sg = 1 when group g was
-- written (or found written by the first send: its first key written holds
-- this instance's mark with the version this script writes there; the
-- instance writes a key with one script at a time, and another instance's
-- write leaves this one's mark as it is), 0 when a key changed or the time
-- was off (and the turn, when claimed, is this instance's now: its next
-- attempt goes at once), 2 when another instance holds the turn of one of
-- its keys (its next attempt waits a little); then, for each group not
-- written, each of its keys' v, n, t: what they hold, to decide again on.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local groups = tonumber(ARGV[5])
local marked = ARGV[7] == '1'
local mark = 'w:' .. ARGV[3]
local resent = marked and ARGV[6] == '1'
local timely = ARGV[1] == '' or math.abs(now - tonumber(ARGV[1])) <= tonumber(ARGV[2])
local base = 8 + 2 * groups
local reply = {time[1], time[2]}
local values = {}
local first = 1
for g = 1, groups do
  local count = tonumber(ARGV[6 + 2 * g])
  local last = first + count - 1
  local status = 0
  local done = false
  if resent then
    for i = first, last do
      local at = base + 5 * (i - 1)
      if ARGV[at + 2] ~= '' then
        done = redis.call('HGET', KEYS[i], mark) == ARGV[at + 1]
        break
      end
    end
  end
  if done then
    status = 1
  else
    local fresh = timely
    -- Keys holding a turn (of this instance, or one run out), to end it.
    local turned = {}
    if fresh then
      for i = first, last do
        local held = redis.call('HMGET', KEYS[i], 'n', 'turn', 'turn_until')
        if (held[1] or '') ~= ARGV[base + 5 * (i - 1)] then
          fresh = false
          break
        end
        turned[i] = held[2]
        if held[2] and held[2] ~= ARGV[3] and tonumber(held[3]) > now then
          fresh = false
          break
        end
      end
    end
    if fresh then
      for i = first, last do
        local at = base + 5 * (i - 1)
        if ARGV[at + 2] ~= '' then
          if marked then
            redis.call('HSET', KEYS[i], 'n', ARGV[at + 1], 'v', ARGV[at + 2], 't', ARGV[at + 4], mark, ARGV[at + 1])
          else
            redis.call('HSET', KEYS[i], 'n', ARGV[at + 1], 'v', ARGV[at + 2], 't', ARGV[at + 4])
          end
          redis.call('PEXPIRE', KEYS[i], ARGV[at + 3])
        end
        -- A turn ends with its holder's decision (any other one has run
        -- out); a key without one needs no command (most keys, most writes).
        if turned[i] then
          redis.call('HDEL', KEYS[i], 'turn', 'turn_until')
        end
      end
      status = 1
    else
      -- Whose turn each key is: a claim takes every key of the group or
      -- none (two instances each holding one key of the other's group
      -- would wait for each other's turn to run out).
      local blocked = false
      for i = first, last do
        local turn = redis.call('HMGET', KEYS[i], 'turn', 'turn_until')
        if turn[1] and turn[1] ~= ARGV[3] and tonumber(turn[2]) > now then
          blocked = true
          break
        end
      end
      if blocked then
        status = 2
      elseif ARGV[7 + 2 * g] == '1' then
        for i = first, last do
          redis.call('HSET', KEYS[i], 'turn', ARGV[3], 'turn_until', now + tonumber(ARGV[4]))
          -- A key held only for a turn goes when the turn does.
          if redis.call('PTTL', KEYS[i]) < 0 then
            redis.call('PEXPIRE', KEYS[i], math.ceil(tonumber(ARGV[4]) / 1000))
          end
        end
      end
      for i = first, last do
        local held = redis.call('HMGET', KEYS[i], 'v', 'n', 't')
        values[#values + 1] = held[1]
        values[#values + 1] = held[2]
        values[#values + 1] = held[3]
      end
    end
  end
  reply[#reply + 1] = status
  first = last + 1
end
for i = 1, #values do
  reply[#reply + 1] = values[i]
end
return reply

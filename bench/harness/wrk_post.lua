-- wrk script for bench.harness.loadgen: POST one JSON body on every keep-alive connection, check each answer, and
-- print one JSON line of results at the end (latencies in microseconds).
-- usage: wrk ... -s bench/harness/wrk_post.lua URL -- PATH BODY STREAM(0|1)

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  req = wrk.format("POST", args[1], {["Content-Type"] = "application/json"}, args[2])
  stream = args[3] == "1"
  ok, bad, chunks, done_marks = 0, 0, 0, 0
end

function request()
  return req
end

function response(status, headers, body)
  if status ~= 200 then
    bad = bad + 1
    return
  end
  if stream then
    local n = 0
    for _ in string.gmatch(body, "data: {") do n = n + 1 end
    chunks = chunks + n
    if string.find(body, "data: [DONE]", 1, true) then done_marks = done_marks + 1 else bad = bad + 1 end
  elseif string.find(body, '"text"', 1, true) then
    ok = ok + 1
  else
    bad = bad + 1
  end
end

function done(summary, latency, requests)
  local t = {ok = 0, bad = 0, chunks = 0, done_marks = 0}
  for _, thread in ipairs(threads) do
    for k, _ in pairs(t) do t[k] = t[k] + (thread:get(k) or 0) end
  end
  local e = summary.errors
  local p = {}
  for _, q in ipairs({50, 90, 99, 99.9}) do table.insert(p, string.format('"%s":%d', q, latency:percentile(q))) end
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,"bad":%d,"chunks":%d,"done_marks":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"mean":%.1f,"stdev":%.1f,"min":%d,"max":%d,"percentiles":{%s}}}\n',
    summary.requests, summary.duration, summary.bytes, t.bad, t.chunks, t.done_marks,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency.stdev, latency.min, latency.max, table.concat(p, ",")))
end

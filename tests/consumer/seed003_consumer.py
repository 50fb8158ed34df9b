import json, time, os
# 持续监听/config/fault.json变化
last_mtime = 0
while True:
    try:
        mtime = os.path.getmtime('/config/fault.json')
        if mtime != last_mtime:
            with open('/config/fault.json') as f:
                status = json.load(f)
            # 检查本Pod所在Node的NPU状态
            if status.get('node', '') == os.getenv('NODE_NAME'):
                for npu in status.get('npus', []):
                    if npu['status'] == 'failed':
                        print(f"CRITICAL: NPU {npu['id']} failed, reason: {npu['reason']}")
                        # 触发优雅退出或降级逻辑
                        os._exit(1)
            last_mtime = mtime
    except Exception as e:
        pass
    time.sleep(0.5)  # 防止空转
